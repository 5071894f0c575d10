/*
 * test_device.c - the device tier (src/tiers/device.c): arena allocation and statistics,
 * pointers, asynchronous copies checked byte for byte with hundreds in flight, completion
 * order, chaining from a callback, synchronous copies, zeroing, bad input, injected
 * faults, close with copies in flight, an arena lent by the caller (one tier at a time),
 * and which backend AUTO and CUDA give.
 *
 * The device suite runs on the emulated backend everywhere. The device_gpu suite runs the
 * same paths on CUDA and skips where no GPU is usable.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "helpers.h"
#include "tiers/cuda_probe.h"
#include "tiers/device.h"

/* Criterion's workers leave with _exit(), so LeakSanitizer's exit-time check never runs
 * there; under ASan each test checks for leaks itself when it ends. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
static void leak_check(void)
{
    cr_assert_eq(__lsan_do_recoverable_leak_check(), 0, "memory leaked (report above)");
}
#else
static void leak_check(void) {}
#endif

TestSuite(device, .fini = leak_check, .timeout = 120);

static struct device *open_kind(enum zinf_device_kind kind, size_t capacity_bytes)
{
    struct device_opts o = {.kind = kind, .capacity_bytes = capacity_bytes};
    struct device *d = NULL;
    int r = device_open(&o, &d);
    cr_assert_eq(r, 0, "device_open: %s", strerror(-r));
    cr_assert_not_null(d);
    return d;
}

static struct device *open_emu(size_t capacity_bytes)
{
    return open_kind(ZINF_DEVICE_EMULATED, capacity_bytes);
}

static bool have_gpu(void)
{
    struct cuda_probe_info info;
    return cuda_probe(&info) > 0;
}

/* The emulated arena takes freed room again before untouched room, as the host tier does:
 * a hundred rounds of two 1 MiB sets stay in the first 2 MiB of a 16 MiB arena. */
Test(device, freed_room_is_taken_again_before_untouched_room)
{
    struct device *d = open_emu(16 * 1048576);
    const uint64_t M = 1048576;
    uint64_t x, y, end = 0;
    for (int i = 0; i < 100; i++) {
        cr_assert_eq(device_alloc(d, M, &x), 0);
        cr_assert_eq(device_alloc(d, M, &y), 0);
        end = x + M > end ? x + M : end;
        end = y + M > end ? y + M : end;
        cr_assert_eq(device_free(d, x), 0);
        cr_assert_eq(device_free(d, y), 0);
    }
    cr_assert_eq(end, 2 * M, "the sets reached %llu bytes into the arena",
                 (unsigned long long)end);
    device_close(d);
}

static bool all_bytes(const void *p, int v, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != (unsigned char)v) return false;
    return true;
}

/* What callbacks record. They run on the device's threads, where Criterion asserts must
 * not be used, so they count and the test thread checks. */
struct tally {
    atomic_uint calls, ok, failed, bad_res;
    pthread_mutex_t lock;
    uint32_t order[2][4096]; /* per direction: the copies' indexes in completion order */
    unsigned norder[2];
};

static void tally_init(struct tally *t)
{
    memset(t, 0, sizeof(*t));
    pthread_mutex_init(&t->lock, NULL);
}

static void tally_fini(struct tally *t)
{
    pthread_mutex_destroy(&t->lock);
}

/* A copy whose data points at its slot in a table of these. */
struct tcopy {
    struct device_copy c;
    struct tally *t;
    uint32_t index;
    int expect; /* the result the callback should see */
    int got;
};

static void tally_cb(struct device_copy *c, int res)
{
    struct tcopy *tc = c->data;
    struct tally *t = tc->t;

    tc->got = res;
    if (res != tc->expect) atomic_fetch_add(&t->bad_res, 1);
    if (res == 0)
        atomic_fetch_add(&t->ok, 1);
    else
        atomic_fetch_add(&t->failed, 1);
    pthread_mutex_lock(&t->lock);
    unsigned n = t->norder[c->dir]++;
    if (n < ARRAY_SIZE(t->order[0])) t->order[c->dir][n] = tc->index;
    pthread_mutex_unlock(&t->lock);
    atomic_fetch_add(&t->calls, 1);
}

static void tcopy_set(struct tcopy *tc, struct tally *t, uint32_t index, enum device_dir dir,
                      uint64_t dev_off, void *host, size_t len)
{
    *tc = (struct tcopy){.t = t, .index = index};
    tc->c = (struct device_copy){
        .dir = dir, .dev_off = dev_off, .host = host, .len = len, .cb = tally_cb, .data = tc};
}

/* ---- open, backends --------------------------------------------------------------- */

Test(device, open_bad_input)
{
    struct device_opts o = {.kind = ZINF_DEVICE_EMULATED, .capacity_bytes = MiB};
    struct device *d = (struct device *)&o;

    cr_assert_eq(device_open(NULL, &d), -EINVAL);
    cr_assert_eq(device_open(&o, NULL), -EINVAL);
    o.kind = (enum zinf_device_kind)42;
    cr_assert_eq(device_open(&o, &d), -EINVAL);
    cr_assert_null(d);
    device_close(NULL); /* a no-op */
}

/* The failure path of open: nothing is left behind (ASan checks the leaks). */
Test(device, open_absurd_capacity_is_enomem)
{
    struct device_opts o = {.kind = ZINF_DEVICE_EMULATED, .capacity_bytes = (size_t)1 << 62};
    struct device *d = (struct device *)&o;

    test_log_capture_start();
    cr_assert_eq(device_open(&o, &d), -ENOMEM);
    cr_assert_null(d);
    o.capacity_bytes = SIZE_MAX;
    cr_assert_eq(device_open(&o, &d), -ENOMEM);
    cr_assert_null(d);
    test_log_capture_stop();
}

Test(device, emulated_capacity_rounds_up_and_defaults)
{
    struct device_stats st;
    struct device *d = open_emu(5000);

    device_get_stats(d, &st);
    cr_assert_not(st.cuda);
    cr_assert_str_eq(st.name, "emulated");
    cr_assert_eq(st.capacity_bytes, 8 * KiB);
    device_close(d);

    d = open_emu(0);
    device_get_stats(d, &st);
    cr_assert_eq(st.capacity_bytes, GiB);
    cr_assert_eq(st.used_bytes, 0);
    cr_assert_eq(st.copies, 0);
    device_close(d);
}

Test(device, auto_is_emulated_without_gpu)
{
    struct device_stats st;

    if (have_gpu()) cr_skip_test("a usable GPU is present: AUTO picks CUDA");
    struct device *d = open_kind(ZINF_DEVICE_AUTO, 16 * MiB);
    device_get_stats(d, &st);
    cr_assert_not(st.cuda);
    cr_assert_str_eq(st.name, "emulated");
    cr_assert_eq(st.capacity_bytes, 16 * MiB);
    device_close(d);
}

Test(device, cuda_without_gpu_is_enodev_with_one_log_line)
{
    struct device_opts o = {.kind = ZINF_DEVICE_CUDA, .capacity_bytes = 16 * MiB};
    struct device *d = (struct device *)&o;
    char text[1024];
    int r, lines = 0;

    if (have_gpu()) cr_skip_test("a usable GPU is present");
    test_log_capture_start();
    r = device_open(&o, &d);
    snprintf(text, sizeof(text), "%s", test_log_text());
    test_log_capture_stop();
    cr_assert_eq(r, -ENODEV, "device_open: %d", r);
    cr_assert_null(d);
    for (const char *p = text; *p; p++)
        lines += *p == '\n';
    cr_assert_eq(lines, 1, "expected one log line, got: %s", text);
    cr_assert(strstr(text, "CUDA") != NULL, "the line should say why: %s", text);
}

Test(device, host_register_is_a_noop_when_emulated)
{
    struct device *d = open_emu(MiB);
    char buf[64];

    cr_assert_eq(device_host_register(d, buf, sizeof(buf)), 0);
    cr_assert_eq(device_host_unregister(d, buf), 0);
    cr_assert_eq(device_host_register(d, NULL, sizeof(buf)), -EINVAL);
    cr_assert_eq(device_host_register(d, buf, 0), -EINVAL);
    cr_assert_eq(device_host_unregister(d, NULL), -EINVAL);
    device_close(d);
}

/* ---- arena ------------------------------------------------------------------------ */

Test(device, alloc_free_stats)
{
    struct device *d = open_emu(MiB);
    struct device_stats st;
    uint64_t a, b, c;

    cr_assert_eq(device_alloc(d, 1, &a), 0);
    cr_assert_eq(a, 0);
    cr_assert_eq(device_alloc(d, 5000, &b), 0);
    cr_assert_eq(b, 4 * KiB);
    device_get_stats(d, &st);
    cr_assert_eq(st.used_bytes, 12 * KiB, "4 KiB granularity: %zu", st.used_bytes);
    cr_assert_eq(st.capacity_bytes, MiB);

    /* The rest fits exactly; then nothing does. */
    cr_assert_eq(device_alloc(d, MiB - 12 * KiB, &c), 0);
    cr_assert_eq(device_alloc(d, 1, &c), -ENOSPC);
    cr_assert_eq(device_free(d, 12 * KiB), 0);
    cr_assert_eq(device_alloc(d, MiB, &c), -ENOSPC);

    /* Free space of 4 KiB and 1 MiB - 12 KiB, not adjacent: 1 MiB - 8 KiB does not fit
     * even though that much is free. */
    cr_assert_eq(device_free(d, a), 0);
    cr_assert_eq(device_alloc(d, MiB - 8 * KiB, &c), -ENOSPC);
    cr_assert_eq(device_free(d, b), 0);
    device_get_stats(d, &st);
    cr_assert_eq(st.used_bytes, 0);
    cr_assert_eq(device_alloc(d, MiB, &c), 0);
    cr_assert_eq(c, 0);
    cr_assert_eq(device_free(d, c), 0);
    device_close(d);
}

/* A lent arena (the trainer's CPU ranks lend their communicator's pool) is the tier's
 * memory: what a copy puts at an offset is in the caller's bytes there. */
static struct device *open_lent(char *arena, size_t arena_bytes, size_t capacity_bytes, int *r)
{
    struct device_opts o = {.kind = ZINF_DEVICE_EMULATED,
                            .capacity_bytes = capacity_bytes,
                            .arena = arena,
                            .arena_bytes = arena_bytes};
    struct device *d = NULL;
    *r = device_open(&o, &d);
    cr_assert((*r == 0) == (d != NULL), "device_open: %d and %p", *r, (void *)d);
    return d;
}

Test(device, a_lent_arena_is_the_tiers_memory)
{
    char *arena = NULL, bytes[100];
    uint64_t off;
    int r;
    cr_assert_eq(posix_memalign((void **)&arena, 4 * KiB, MiB), 0);
    memset(arena, 0x55, MiB);
    struct device *d = open_lent(arena, MiB, MiB, &r);
    cr_assert_eq(r, 0, "%s", strerror(-r));
    cr_assert_eq(device_alloc(d, 8 * KiB, &off), 0);
    cr_assert_eq(device_alloc(d, 8 * KiB, &off), 0);
    cr_assert_eq(device_ptr(d, off), arena + off);
    memset(bytes, 0xa7, sizeof(bytes));
    cr_assert_eq(device_copy_sync(d, DEVICE_H2D, off + 10, bytes, sizeof(bytes)), 0);
    cr_assert_eq(memcmp(arena + off + 10, bytes, sizeof(bytes)), 0);
    cr_assert_eq((unsigned char)arena[off + 9], 0x55, "the byte before is the caller's still");
    device_close(d);
    cr_assert_eq((unsigned char)arena[off + 10], 0xa7, "closing leaves the lender's memory");
    free(arena);
}

/* An arena backs one tier at a time: a second tier on any of its bytes (the same arena,
 * or one overlapping it) is refused, as two engines would load their tensors over each
 * other's from its start; the bytes next to it are another arena, and once the first tier
 * closes its arena can be lent again. */
Test(device, a_lent_arena_backs_one_tier_at_a_time)
{
    char *arena = NULL;
    int r;
    cr_assert_eq(posix_memalign((void **)&arena, 4 * KiB, 2 * MiB), 0);
    struct device *a = open_lent(arena, MiB, MiB, &r);
    cr_assert_eq(r, 0, "%s", strerror(-r));
    cr_assert_null(open_lent(arena, MiB, MiB, &r));
    cr_assert_eq(r, -EBUSY, "the same arena twice: %d", r);
    cr_assert_null(open_lent(arena + MiB / 2, MiB, MiB, &r));
    cr_assert_eq(r, -EBUSY, "an arena over the second half of the first: %d", r);
    cr_assert_null(open_lent(arena + MiB - 4 * KiB, MiB, MiB, &r));
    cr_assert_eq(r, -EBUSY, "an arena over the first's last page: %d", r);
    struct device *b = open_lent(arena + MiB, MiB, MiB, &r);
    cr_assert_eq(r, 0, "the next MiB: %s", strerror(-r));
    device_close(a);
    a = open_lent(arena + 4 * KiB, MiB - 4 * KiB, MiB - 4 * KiB, &r);
    cr_assert_eq(r, 0, "lent again after the close: %s", strerror(-r));
    device_close(a);
    device_close(b);
    free(arena);
}

/* What cannot be an arena: smaller than the tier, not on a 4 KiB boundary, or asked to be
 * shared with another process (a memfd of the tier's own). */
Test(device, a_lent_arena_bad_input)
{
    char *arena = NULL;
    int r;
    cr_assert_eq(posix_memalign((void **)&arena, 4 * KiB, MiB), 0);
    cr_assert_null(open_lent(arena, MiB / 2, MiB, &r));
    cr_assert_eq(r, -EINVAL, "smaller than the tier: %d", r);
    cr_assert_null(open_lent(arena + 512, MiB - 4 * KiB, 512 * KiB, &r));
    cr_assert_eq(r, -EINVAL, "unaligned: %d", r);
    struct device_opts o = {.kind = ZINF_DEVICE_EMULATED, .capacity_bytes = MiB, .shared = true,
                            .arena = arena, .arena_bytes = MiB};
    struct device *d = NULL;
    cr_assert_eq(device_open(&o, &d), -EINVAL);
    cr_assert_null(d);
    /* None of these holds the arena: it can be lent now. */
    d = open_lent(arena, MiB, MiB, &r);
    cr_assert_eq(r, 0, "%s", strerror(-r));
    device_close(d);
    free(arena);
}

Test(device, alloc_free_bad_input)
{
    struct device *d = open_emu(MiB);
    uint64_t a;

    cr_assert_eq(device_alloc(d, 0, &a), -EINVAL);
    cr_assert_eq(device_alloc(d, 4096, NULL), -EINVAL);
    cr_assert_eq(device_alloc(NULL, 4096, &a), -EINVAL);
    cr_assert_eq(device_alloc(d, 2 * MiB, &a), -ENOSPC);
    cr_assert_eq(device_free(d, 0), -EINVAL, "nothing allocated yet");
    cr_assert_eq(device_alloc(d, 8 * KiB, &a), 0);
    cr_assert_eq(device_free(d, a + 4 * KiB), -EINVAL, "not the start of an allocation");
    cr_assert_eq(device_free(d, 3 * MiB), -EINVAL);
    cr_assert_eq(device_free(d, a), 0);
    cr_assert_eq(device_free(d, a), -EINVAL, "double free");
    device_close(d);
}

struct alloc_worker {
    struct device *d;
    uint64_t seed;
    atomic_uint *errors;
};

static void *alloc_worker(void *arg)
{
    struct alloc_worker *w = arg;
    uint64_t offs[16], s = w->seed;

    for (int round = 0; round < 500; round++) {
        for (int i = 0; i < 16; i++)
            if (device_alloc(w->d, 1 + test_rand(&s) % (16 * KiB), &offs[i]) != 0)
                atomic_fetch_add(w->errors, 1);
        for (int i = 0; i < 16; i++)
            if (device_free(w->d, offs[i]) != 0) atomic_fetch_add(w->errors, 1);
    }
    return NULL;
}

Test(device, alloc_from_many_threads)
{
    struct device *d = open_emu(16 * MiB); /* room for every thread's 16 x 16 KiB */
    struct alloc_worker w[4];
    pthread_t th[4];
    atomic_uint errors = 0;
    struct device_stats st;

    for (int i = 0; i < 4; i++) {
        w[i] = (struct alloc_worker){d, 1000 + (uint64_t)i, &errors};
        cr_assert_eq(pthread_create(&th[i], NULL, alloc_worker, &w[i]), 0);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    cr_assert_eq(atomic_load(&errors), 0);
    device_get_stats(d, &st);
    cr_assert_eq(st.used_bytes, 0);
    device_close(d);
}

Test(device, pointers)
{
    static const size_t sizes[] = {1, 4 * KiB, 4 * KiB + 1, 64 * KiB, 3 * KiB};
    struct device *d = open_emu(MiB);
    uint64_t off[ARRAY_SIZE(sizes)];
    char *p[ARRAY_SIZE(sizes)];

    for (size_t i = 0; i < ARRAY_SIZE(sizes); i++) {
        cr_assert_eq(device_alloc(d, sizes[i], &off[i]), 0);
        p[i] = device_ptr(d, off[i]);
        cr_assert_not_null(p[i]);
        cr_assert(is_aligned((uintptr_t)p[i], 4 * KiB), "%p not 4 KiB aligned", p[i]);
        cr_assert_eq(p[i] - p[0], (ptrdiff_t)(off[i] - off[0]));
        for (size_t j = 0; j < i; j++)
            cr_assert_neq(p[i], p[j]);
        memset(p[i], (int)i + 1, sizes[i]); /* emulated: host memory, writable */
    }
    /* Writes through the pointer are what a device->host copy reads. */
    char *back = malloc(64 * KiB);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, off[3], back, 64 * KiB), 0);
    cr_assert(all_bytes(back, 4, 64 * KiB));
    free(back);

    cr_assert_not_null(device_ptr(d, MiB - 1));
    cr_assert_null(device_ptr(d, MiB));
    cr_assert_null(device_ptr(NULL, 0));
    for (size_t i = 0; i < ARRAY_SIZE(sizes); i++)
        cr_assert_eq(device_free(d, off[i]), 0);
    device_close(d);
}

/* ---- copies ----------------------------------------------------------------------- */

#define NCOPIES 512
#define SLOT (64 * KiB)

/* Hundreds of copies in flight each way, of lengths that are not multiples of 4 KiB, at
 * offsets that are not either, then both directions at once. */
static void many_in_flight(struct device *d)
{
    struct tally t;
    struct tcopy *tc = calloc(2 * NCOPIES, sizeof(*tc));
    size_t len[NCOPIES];
    uint64_t base;
    char *src = test_aligned_alloc(NCOPIES * SLOT), *dst = test_aligned_alloc(NCOPIES * SLOT);
    char *src2 = test_aligned_alloc(NCOPIES * SLOT);
    uint64_t s = 7;
    struct device_stats st0, st;

    cr_assert(tc && src && dst && src2);
    tally_init(&t);
    device_get_stats(d, &st0);
    cr_assert_eq(device_alloc(d, 2 * NCOPIES * SLOT, &base), 0);
    test_fill_random(src, NCOPIES * SLOT, 1);
    test_fill_random(src2, NCOPIES * SLOT, 2);
    memset(dst, 0, NCOPIES * SLOT);
    cr_assert_eq(device_host_register(d, src, NCOPIES * SLOT), 0);
    cr_assert_eq(device_host_register(d, dst, NCOPIES * SLOT), 0);
    cr_assert_eq(device_host_register(d, src2, NCOPIES * SLOT), 0);

    uint64_t total = 0;
    for (uint32_t i = 0; i < NCOPIES; i++) {
        size_t skew = test_rand(&s) % 512;
        len[i] = 1 + test_rand(&s) % (SLOT - skew - 1);
        tcopy_set(&tc[i], &t, i, DEVICE_H2D, base + (uint64_t)i * SLOT + skew,
                  src + (size_t)i * SLOT + skew, len[i]);
        total += len[i];
    }
    for (uint32_t i = 0; i < NCOPIES; i++)
        cr_assert_eq(device_copy_async(d, &tc[i].c), 0);
    device_drain(d);
    cr_assert_eq(atomic_load(&t.calls), NCOPIES);
    cr_assert_eq(atomic_load(&t.ok), NCOPIES);

    /* Read every slot back, and at the same time write the second half of the arena. */
    for (uint32_t i = 0; i < NCOPIES; i++) {
        struct device_copy *c = &tc[i].c;
        tcopy_set(&tc[i], &t, i, DEVICE_D2H, c->dev_off, dst + (c->dev_off - base), c->len);
        tcopy_set(&tc[NCOPIES + i], &t, NCOPIES + i, DEVICE_H2D,
                  base + (uint64_t)(NCOPIES + i) * SLOT, src2 + (size_t)i * SLOT, SLOT);
    }
    for (uint32_t i = 0; i < NCOPIES; i++) {
        cr_assert_eq(device_copy_async(d, &tc[i].c), 0);
        cr_assert_eq(device_copy_async(d, &tc[NCOPIES + i].c), 0);
    }
    device_drain(d);
    cr_assert_eq(atomic_load(&t.calls), 3 * NCOPIES);
    cr_assert_eq(atomic_load(&t.bad_res), 0);
    for (uint32_t i = 0; i < NCOPIES; i++) {
        size_t at = (size_t)(tc[i].c.dev_off - base);
        cr_assert(memcmp(dst + at, src + at, len[i]) == 0, "copy %u differs", i);
    }
    /* The second half, read back in one synchronous copy. */
    memset(dst, 0, NCOPIES * SLOT);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, base + NCOPIES * SLOT, dst, NCOPIES * SLOT), 0);
    cr_assert(memcmp(dst, src2, NCOPIES * SLOT) == 0);

    device_get_stats(d, &st);
    cr_assert_eq(st.bytes_h2d - st0.bytes_h2d, total + (uint64_t)NCOPIES * SLOT);
    cr_assert_eq(st.bytes_d2h - st0.bytes_d2h, total + (uint64_t)NCOPIES * SLOT);
    cr_assert_eq(st.copies - st0.copies, 3 * NCOPIES + 1);

    cr_assert_eq(device_host_unregister(d, src2), 0);
    cr_assert_eq(device_host_unregister(d, dst), 0);
    cr_assert_eq(device_host_unregister(d, src), 0);
    cr_assert_eq(device_free(d, base), 0);
    tally_fini(&t);
    free(src2);
    free(dst);
    free(src);
    free(tc);
}

Test(device, copies_many_in_flight_both_directions)
{
    struct device *d = open_emu(2 * NCOPIES * SLOT);
    many_in_flight(d);
    device_close(d);
}

/* Each direction completes in the order it was submitted. */
static void fifo_order(struct device *d)
{
    enum { N = 1024 };
    struct tally t;
    struct tcopy *tc = calloc(N, sizeof(*tc));
    char *host = test_aligned_alloc(N * 8 * KiB);
    uint64_t base, s = 3;

    cr_assert(tc && host);
    tally_init(&t);
    test_fill_random(host, N * 8 * KiB, 9);
    cr_assert_eq(device_alloc(d, N * 8 * KiB, &base), 0);
    for (uint32_t i = 0; i < N; i++) {
        /* Directions in a pseudo-random mix; sizes vary so that copies take different
         * times. Each copy has its own bytes, so order is the only thing checked. */
        enum device_dir dir = test_rand(&s) & 1 ? DEVICE_D2H : DEVICE_H2D;
        tcopy_set(&tc[i], &t, i, dir, base + (uint64_t)i * 8 * KiB, host + (size_t)i * 8 * KiB,
                  1 + test_rand(&s) % (8 * KiB));
        cr_assert_eq(device_copy_async(d, &tc[i].c), 0);
    }
    device_drain(d);
    cr_assert_eq(atomic_load(&t.calls), N);
    cr_assert_eq(t.norder[0] + t.norder[1], N);
    for (int dir = 0; dir < 2; dir++)
        for (unsigned k = 1; k < t.norder[dir]; k++)
            cr_assert_lt(t.order[dir][k - 1], t.order[dir][k],
                         "direction %d: copy %u completed before copy %u", dir, t.order[dir][k],
                         t.order[dir][k - 1]);
    cr_assert_eq(device_free(d, base), 0);
    tally_fini(&t);
    free(host);
    free(tc);
}

Test(device, completion_is_fifo_per_direction)
{
    struct device *d = open_emu(16 * MiB);
    fifo_order(d);
    device_close(d);
}

/* A callback that submits the next copy of a chain, on the device's thread. */
struct chain {
    struct device *d;
    struct device_copy c;
    char *host;
    uint64_t base;
    unsigned next, total;
    atomic_uint calls, errors, shutdowns;
    atomic_bool finished;
    pthread_t caller;
};

static void chain_cb(struct device_copy *c, int res)
{
    struct chain *ch = c->data;

    atomic_fetch_add(&ch->calls, 1);
    if (res != 0 || pthread_equal(pthread_self(), ch->caller)) atomic_fetch_add(&ch->errors, 1);
    if (++ch->next == ch->total) {
        atomic_store(&ch->finished, true);
        return;
    }
    unsigned i = ch->next % 64;
    c->dev_off = ch->base + (uint64_t)i * 4 * KiB;
    c->host = ch->host + (size_t)i * 4 * KiB;
    int r = device_copy_async(ch->d, c);
    if (r == -ESHUTDOWN) {
        atomic_fetch_add(&ch->shutdowns, 1);
        atomic_store(&ch->finished, true);
    } else if (r != 0) {
        atomic_fetch_add(&ch->errors, 1);
        atomic_store(&ch->finished, true);
    }
}

static void chain_start(struct chain *ch, struct device *d, unsigned total)
{
    ch->d = d;
    ch->total = total;
    ch->caller = pthread_self();
    ch->host = test_aligned_alloc(64 * 4 * KiB);
    cr_assert_not_null(ch->host);
    test_fill_random(ch->host, 64 * 4 * KiB, 5);
    cr_assert_eq(device_alloc(d, 64 * 4 * KiB, &ch->base), 0);
    ch->c = (struct device_copy){.dir = DEVICE_H2D,
                                 .dev_off = ch->base,
                                 .host = ch->host,
                                 .len = 4 * KiB,
                                 .cb = chain_cb,
                                 .data = ch};
    cr_assert_eq(device_copy_async(d, &ch->c), 0);
}

Test(device, callback_submits_the_next_copy)
{
    struct device *d = open_emu(MiB);
    struct chain ch = {0};

    chain_start(&ch, d, 300);
    device_drain(d); /* a chained copy is submitted before its parent retires */
    cr_assert(atomic_load(&ch.finished));
    cr_assert_eq(atomic_load(&ch.calls), 300);
    cr_assert_eq(atomic_load(&ch.errors), 0);
    cr_assert(memcmp(device_ptr(d, ch.base), ch.host, 64 * 4 * KiB) == 0);
    cr_assert_eq(device_free(d, ch.base), 0);
    free(ch.host);
    device_close(d);
}

Test(device, copy_sync_both_directions)
{
    struct device *d = open_emu(MiB);
    char *a = malloc(100000), *b = malloc(100000);
    uint64_t off;

    test_fill_random(a, 100000, 11);
    memset(b, 0, 100000);
    cr_assert_eq(device_alloc(d, 100000, &off), 0);
    cr_assert_eq(device_copy_sync(d, DEVICE_H2D, off, a, 100000), 0);
    cr_assert(memcmp(device_ptr(d, off), a, 100000) == 0);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, off + 1, b, 99999), 0);
    cr_assert(memcmp(b, a + 1, 99999) == 0);

    cr_assert_eq(device_copy_sync(d, DEVICE_H2D, off, NULL, 10), -EINVAL);
    cr_assert_eq(device_copy_sync(d, DEVICE_H2D, MiB - 10, a, 11), -EINVAL);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, off, b, 0), -EINVAL);
    cr_assert_eq(device_copy_sync(NULL, DEVICE_D2H, off, b, 10), -EINVAL);
    cr_assert_eq(device_free(d, off), 0);
    free(b);
    free(a);
    device_close(d);
}

/* device_copy_now waits for no queued copy and no callback: here a callback blocks on a
 * lock the caller holds (as the engine's do), and the copies still finish. */
static pthread_mutex_t now_lock = PTHREAD_MUTEX_INITIALIZER;

static void now_blocked_cb(struct device_copy *c, int res)
{
    (void)c, (void)res;
    pthread_mutex_lock(&now_lock);
    pthread_mutex_unlock(&now_lock);
}

static void copy_now_under_a_lock_callbacks_take(struct device *d)
{
    const size_t n = 300000;
    char *a = malloc(n), *b = malloc(n), *q = malloc(n);
    uint64_t off, qoff;
    cr_assert(a && b && q);
    test_fill_random(a, n, 15);
    test_fill_random(q, n, 16);
    cr_assert_eq(device_alloc(d, n, &off), 0);
    cr_assert_eq(device_alloc(d, n, &qoff), 0);
    pthread_mutex_lock(&now_lock);
    struct device_copy c = {.dir = DEVICE_H2D, .dev_off = qoff, .host = q, .len = n, .cb = now_blocked_cb};
    cr_assert_eq(device_copy_async(d, &c), 0);
    cr_assert_eq(device_copy_now(d, DEVICE_H2D, off, a, n), 0);
    memset(b, 0, n);
    cr_assert_eq(device_copy_now(d, DEVICE_D2H, off + 7, b, n - 7), 0);
    cr_assert(memcmp(b, a + 7, n - 7) == 0, "device_copy_now lost bytes");
    cr_assert_eq(device_copy_now(d, DEVICE_D2H, off, NULL, 10), -EINVAL);
    cr_assert_eq(device_copy_now(d, DEVICE_H2D, off, a, 0), -EINVAL);
    cr_assert_eq(device_copy_now(d, DEVICE_H2D, off + 2 * MiB, a, 10), -EINVAL);
    cr_assert_eq(device_copy_now(NULL, DEVICE_H2D, off, a, 10), -EINVAL);
    pthread_mutex_unlock(&now_lock);
    device_drain(d);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, qoff, b, n), 0);
    cr_assert(memcmp(b, q, n) == 0, "the queued copy");
    cr_assert_eq(device_free(d, off), 0);
    cr_assert_eq(device_free(d, qoff), 0);
    free(q);
    free(b);
    free(a);
}

Test(device, copy_now_under_a_lock_callbacks_take)
{
    struct device *d = open_emu(MiB);
    copy_now_under_a_lock_callbacks_take(d);
    device_close(d);
}

static void zero_ranges(struct device *d)
{
    const size_t n = MiB;
    char *src = test_aligned_alloc(n), *back = test_aligned_alloc(n);
    uint64_t off;

    cr_assert(src && back);
    test_fill_random(src, n, 13);
    cr_assert_eq(device_alloc(d, n, &off), 0);
    cr_assert_eq(device_copy_sync(d, DEVICE_H2D, off, src, n), 0);

    /* A large range with ragged ends, and a small one. */
    struct {
        size_t at, len;
    } z[] = {{100, 300000}, {500000, 777}};
    for (size_t i = 0; i < ARRAY_SIZE(z); i++) {
        cr_assert_eq(device_zero(d, off + z[i].at, z[i].len), 0);
        memset(src + z[i].at, 0, z[i].len);
    }
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, off, back, n), 0);
    cr_assert(memcmp(back, src, n) == 0, "zeroed ranges or their neighbours are wrong");

    /* Zeroed memory can be written again. */
    test_fill_random(src, n, 14);
    cr_assert_eq(device_copy_sync(d, DEVICE_H2D, off, src, n), 0);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, off, back, n), 0);
    cr_assert(memcmp(back, src, n) == 0);
    cr_assert_eq(device_free(d, off), 0);
    free(back);
    free(src);
}

Test(device, zero)
{
    struct device *d = open_emu(2 * MiB);
    zero_ranges(d);
    cr_assert_eq(device_zero(d, 0, 2 * MiB), 0);
    cr_assert(all_bytes(device_ptr(d, 0), 0, 2 * MiB));
    device_close(d);
}

/* Zeros queued like a copy (device_copy.zero): they land after the copies into the arena
 * queued before them and before those queued after, and their callback says so. */
static void zero_copies_in_order(struct device *d)
{
    const size_t n = 512 * KiB;
    char *a = test_aligned_alloc(n), *b = test_aligned_alloc(n), *back = test_aligned_alloc(n);
    struct tally t;
    struct tcopy tc[3];
    uint64_t off;

    cr_assert(a && b && back);
    tally_init(&t);
    test_fill_random(a, n, 31);
    test_fill_random(b, n, 32);
    cr_assert_eq(device_alloc(d, n, &off), 0);
    tcopy_set(&tc[0], &t, 0, DEVICE_H2D, off, a, n);                   /* all of a */
    tcopy_set(&tc[1], &t, 1, DEVICE_H2D, off + 4096, NULL, 300 * KiB); /* zeros over it */
    tc[1].c.zero = true;
    tcopy_set(&tc[2], &t, 2, DEVICE_H2D, off + 200 * KiB, b, 8192);    /* then b, inside */
    for (int i = 0; i < 3; i++)
        cr_assert_eq(device_copy_async(d, &tc[i].c), 0);
    for (int i = 0; i < 20000 && atomic_load(&t.calls) < 3; i++)
        usleep(500);
    cr_assert_eq(atomic_load(&t.calls), 3);
    cr_assert_eq(atomic_load(&t.bad_res), 0);
    cr_assert_eq(t.order[DEVICE_H2D][0], 0);
    cr_assert_eq(t.order[DEVICE_H2D][1], 1);
    cr_assert_eq(t.order[DEVICE_H2D][2], 2);
    memset(a + 4096, 0, 300 * KiB);
    memcpy(a + 200 * KiB, b, 8192);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, off, back, n), 0);
    cr_assert(memcmp(back, a, n) == 0, "the zeros did not land in queue order");

    /* Zeros only go to the device; a zero copy out of it is refused. */
    struct tcopy bad;
    tcopy_set(&bad, &t, 3, DEVICE_D2H, off, NULL, 4096);
    bad.c.zero = true;
    cr_assert_eq(device_copy_async(d, &bad.c), -EINVAL);
    cr_assert_eq(device_free(d, off), 0);
    tally_fini(&t);
    free(back);
    free(b);
    free(a);
}

Test(device, zero_copies_run_in_queue_order)
{
    struct device *d = open_emu(MiB);
    zero_copies_in_order(d);
    device_close(d);
}

Test(device, zero_bad_input)
{
    struct device *d = open_emu(MiB);

    cr_assert_eq(device_zero(d, 0, 0), -EINVAL);
    cr_assert_eq(device_zero(d, MiB - 4, 5), -EINVAL);
    cr_assert_eq(device_zero(d, MiB, 1), -EINVAL);
    cr_assert_eq(device_zero(d, UINT64_MAX, 2), -EINVAL);
    cr_assert_eq(device_zero(NULL, 0, 1), -EINVAL);
    device_close(d);
}

/* A copy refused at submission never runs its callback. */
Test(device, bad_copies_are_einval_and_never_call_back)
{
    struct device *d = open_emu(MiB);
    struct tally t;
    struct tcopy tc;
    char buf[64];

    tally_init(&t);
    struct {
        uint64_t off;
        size_t len;
        void *host;
        bool cb;
        int dir;
    } bad[] = {
        {MiB - 32, 64, buf, true, DEVICE_H2D},       /* runs past the end */
        {MiB, 1, buf, true, DEVICE_D2H},             /* starts at the end */
        {UINT64_MAX - 8, 64, buf, true, DEVICE_H2D}, /* offset + length overflows */
        {0, 0, buf, true, DEVICE_H2D},               /* empty */
        {0, 64, NULL, true, DEVICE_D2H},             /* no host memory */
        {0, 64, buf, false, DEVICE_H2D},             /* no callback */
        {0, 64, buf, true, 7},                       /* no such direction */
    };
    for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
        tcopy_set(&tc, &t, (uint32_t)i, (enum device_dir)bad[i].dir, bad[i].off, bad[i].host,
                  bad[i].len);
        if (!bad[i].cb) tc.c.cb = NULL;
        cr_assert_eq(device_copy_async(d, &tc.c), -EINVAL, "case %zu", i);
    }
    cr_assert_eq(device_copy_async(d, NULL), -EINVAL);
    tcopy_set(&tc, &t, 0, DEVICE_H2D, 0, buf, sizeof(buf));
    cr_assert_eq(device_copy_async(NULL, &tc.c), -EINVAL);
    device_drain(d);
    cr_assert_eq(atomic_load(&t.calls), 0);

    /* The last byte of the arena is fine. */
    cr_assert_eq(device_copy_sync(d, DEVICE_H2D, MiB - 1, buf, 1), 0);
    device_close(d);
    tally_fini(&t);
}

/* The nth copy fails with the injected error and moves nothing; the rest are fine. */
static void injected_fault(struct device *d)
{
    enum { N = 6 };
    struct tally t;
    struct tcopy tc[N];
    char *src = test_aligned_alloc(N * 4 * KiB), *back = test_aligned_alloc(N * 4 * KiB);
    uint64_t base;
    struct device_stats st0, st;

    cr_assert(src && back);
    tally_init(&t);
    device_get_stats(d, &st0);
    test_fill_random(src, N * 4 * KiB, 17);
    cr_assert_eq(device_alloc(d, N * 4 * KiB, &base), 0);
    cr_assert_eq(device_zero(d, base, N * 4 * KiB), 0);

    device_fault_set(d, 3, -EIO);
    for (uint32_t i = 0; i < N; i++) {
        tcopy_set(&tc[i], &t, i, DEVICE_H2D, base + i * 4 * KiB, src + i * 4 * KiB, 4 * KiB);
        tc[i].expect = i == 2 ? -EIO : 0;
        cr_assert_eq(device_copy_async(d, &tc[i].c), 0);
    }
    device_drain(d);
    cr_assert_eq(atomic_load(&t.calls), N);
    cr_assert_eq(atomic_load(&t.bad_res), 0, "third copy got %d", tc[2].got);
    cr_assert_eq(atomic_load(&t.failed), 1);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, base, back, N * 4 * KiB), 0);
    for (uint32_t i = 0; i < N; i++) {
        if (i == 2)
            cr_assert(all_bytes(back + i * 4 * KiB, 0, 4 * KiB), "faulted copy moved bytes");
        else
            cr_assert(memcmp(back + i * 4 * KiB, src + i * 4 * KiB, 4 * KiB) == 0);
    }
    /* The fault fired once: the same copies again all succeed. */
    for (uint32_t i = 0; i < N; i++)
        cr_assert_eq(
            device_copy_sync(d, DEVICE_H2D, base + i * 4 * KiB, src + i * 4 * KiB, 4 * KiB), 0);
    /* A fault on a device->host copy, through the synchronous call. */
    device_fault_set(d, 1, -ENOMEM);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, base, back, 4 * KiB), -ENOMEM);
    /* Disarmed before it fires. */
    device_fault_set(d, 1, -EIO);
    device_fault_set(d, 0, 0);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, base, back, N * 4 * KiB), 0);
    cr_assert(memcmp(back, src, N * 4 * KiB) == 0);

    device_get_stats(d, &st);
    cr_assert_eq(st.copies - st0.copies, (N - 1) + 1 + N + 1, "failed copies are not counted");
    cr_assert_eq(device_free(d, base), 0);
    tally_fini(&t);
    free(back);
    free(src);
}

Test(device, injected_fault_then_recovery)
{
    struct device *d = open_emu(MiB);
    injected_fault(d);
    device_close(d);
}

/* ---- close ------------------------------------------------------------------------ */

Test(device, close_with_copies_in_flight_runs_every_callback)
{
    enum { N = 400 };
    struct device *d = open_emu(N * 16 * KiB);
    struct tally t;
    struct tcopy *tc = calloc(N, sizeof(*tc));
    char *host = test_aligned_alloc(N * 16 * KiB);

    cr_assert(tc && host);
    tally_init(&t);
    test_fill_random(host, N * 16 * KiB, 19);
    for (uint32_t i = 0; i < N; i++) {
        tcopy_set(&tc[i], &t, i, i % 3 ? DEVICE_H2D : DEVICE_D2H, (uint64_t)i * 16 * KiB,
                  host + (size_t)i * 16 * KiB, 16 * KiB);
        cr_assert_eq(device_copy_async(d, &tc[i].c), 0);
    }
    device_close(d);
    cr_assert_eq(atomic_load(&t.calls), N);
    cr_assert_eq(atomic_load(&t.ok), N);
    tally_fini(&t);
    free(host);
    free(tc);
}

/* A chain that never ends by itself: close lets the copies in flight finish and refuses
 * the next one with -ESHUTDOWN, which is what ends the chain and lets close return. */
Test(device, close_refuses_new_copies_with_eshutdown)
{
    struct device *d = open_emu(MiB);
    struct chain ch = {0};

    chain_start(&ch, d, UINT32_MAX);
    device_close(d);
    cr_assert(atomic_load(&ch.finished));
    cr_assert_eq(atomic_load(&ch.shutdowns), 1);
    cr_assert_eq(atomic_load(&ch.errors), 0);
    cr_assert_geq(atomic_load(&ch.calls), 1);
    free(ch.host);
}

Test(device, drain_when_idle_returns)
{
    struct device *d = open_emu(MiB);
    device_drain(d);
    device_drain(NULL);
    device_close(d);
}

/* ---- CUDA: the same paths on a GPU; skipped where none is usable ------------------ */

TestSuite(device_gpu, .fini = leak_check, .timeout = 300);

static struct device *open_cuda(size_t capacity_bytes)
{
    if (!have_gpu()) cr_skip_test("no usable CUDA device");
    return open_kind(ZINF_DEVICE_CUDA, capacity_bytes);
}

Test(device_gpu, open_stats_alloc)
{
    struct device *d = open_cuda(64 * MiB);
    struct device_stats st;
    uint64_t a, b;

    device_get_stats(d, &st);
    cr_assert(st.cuda);
    cr_assert_neq(st.name[0], '\0');
    cr_assert_str_neq(st.name, "emulated");
    cr_assert_eq(st.capacity_bytes, 64 * MiB);
    cr_assert_eq(device_alloc(d, 5000, &a), 0);
    cr_assert_eq(device_alloc(d, 64 * MiB, &b), -ENOSPC);
    cr_assert_not_null(device_ptr(d, a));
    device_get_stats(d, &st);
    cr_assert_eq(st.used_bytes, 8 * KiB);
    cr_assert_eq(device_free(d, a), 0);
    cr_assert_eq(device_free(d, a), -EINVAL);
    device_close(d);

    d = open_kind(ZINF_DEVICE_AUTO, 64 * MiB);
    device_get_stats(d, &st);
    cr_assert(st.cuda, "AUTO picks CUDA where a GPU is usable");
    device_close(d);
}

Test(device_gpu, round_trip_through_pinned_memory)
{
    const size_t n = 32 * MiB;
    struct device *d = open_cuda(128 * MiB);
    char *src = test_aligned_alloc(n), *back = test_aligned_alloc(n);
    uint64_t off;

    cr_assert(src && back);
    test_fill_random(src, n, 23);
    memset(back, 0, n);
    cr_assert_eq(device_host_register(d, src, n), 0);
    cr_assert_eq(device_host_register(d, src, n), 0, "registering twice is fine");
    cr_assert_eq(device_host_register(d, back, n), 0);
    cr_assert_eq(device_alloc(d, n, &off), 0);
    cr_assert_eq(device_copy_sync(d, DEVICE_H2D, off, src, n), 0);
    cr_assert_eq(device_copy_sync(d, DEVICE_D2H, off, back, n), 0);
    cr_assert(memcmp(src, back, n) == 0, "round trip through the GPU changed the bytes");
    cr_assert_eq(device_host_unregister(d, back), 0);
    cr_assert_eq(device_host_unregister(d, src), 0);
    cr_assert_eq(device_free(d, off), 0);
    free(back);
    free(src);
    device_close(d);
}

Test(device_gpu, copies_many_in_flight_both_directions)
{
    struct device *d = open_cuda(2 * NCOPIES * SLOT);
    many_in_flight(d);
    device_close(d);
}

Test(device_gpu, completion_is_fifo_per_direction)
{
    struct device *d = open_cuda(16 * MiB);
    fifo_order(d);
    device_close(d);
}

Test(device_gpu, zero)
{
    struct device *d = open_cuda(2 * MiB);
    zero_ranges(d);
    device_close(d);
}

Test(device_gpu, injected_fault_then_recovery)
{
    struct device *d = open_cuda(MiB);
    injected_fault(d);
    device_close(d);
}

Test(device_gpu, close_refuses_new_copies_with_eshutdown)
{
    struct device *d = open_cuda(MiB);
    struct chain ch = {0};

    chain_start(&ch, d, UINT32_MAX);
    device_close(d);
    cr_assert_eq(atomic_load(&ch.shutdowns), 1);
    cr_assert_eq(atomic_load(&ch.errors), 0);
    free(ch.host);
}

Test(device_gpu, zero_copies_run_in_queue_order)
{
    struct device *d = open_cuda(MiB);
    zero_copies_in_order(d);
    device_close(d);
}

Test(device_gpu, copy_now_under_a_lock_callbacks_take)
{
    struct device *d = open_cuda(MiB);
    copy_now_under_a_lock_callbacks_take(d);
    device_close(d);
}
