/*
 * test_persist.c - durability (src/engine/persist.c, resume.c, manifest.c) through the public
 * API: zinf_flush, zinf_close and a reopen with ZINF_OPEN_RESUME bring back every byte of
 * every tensor, whatever its home and wherever its newest copy was; swap space striped over
 * two directories; a flipped byte in a swap file and a corrupt or truncated manifest are
 * refused, never loaded or crashed on; a reopen with OVERWRITE starts empty; and a process
 * killed with SIGKILL at a random moment while it writes and flushes leaves each tensor
 * holding exactly one complete version.
 *
 * The device tier is emulated. What happens between two flushes in memory is
 * test_engine.c's.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "api.h"
#include "engine/engine.h"
#include "helpers.h"
#include "zinf.h"

#define BLOCK (64 * KiB)
#define QD 8
#define MANIFEST "zinf-manifest.json"

static char *dir, *dir2, *snapshot_dir;

static void setup(void)
{
    dir = test_tmpdir("persist");
    dir2 = test_tmpdir("persist2");
    cr_assert(dir && dir2);
}

static void teardown(void)
{
    test_log_capture_stop();
    test_rmtree(dir);
    test_rmtree(dir2);
    dir = dir2 = NULL;
}

TestSuite(persist, .init = setup, .fini = teardown, .timeout = 120);

static const char *extra_dirs[2];

static int open_at(unsigned flags, bool two_dirs, zinf_engine **e)
{
    extra_dirs[0] = dir2;
    extra_dirs[1] = NULL;
    struct zinf_options o = {.nvme_path = dir,
                             .nvme_paths_extra = two_dirs ? extra_dirs : NULL,
                             .device_bytes = 8 * MiB,
                             .host_bytes = 4 * MiB,
                             .block_size = BLOCK,
                             .queue_depth = QD,
                             .device_kind = ZINF_DEVICE_EMULATED,
                             .flags = flags};
    *e = NULL;
    return zinf_open(&o, e);
}

static zinf_engine *open_eng(unsigned flags, bool two_dirs)
{
    zinf_engine *e;
    int r = open_at(flags, two_dirs, &e);
    cr_assert_eq(r, 0, "zinf_open: %s", zinf_strerror(r));
    return e;
}

static zinf_tensor look(zinf_engine *e, const char *name)
{
    zinf_tensor t = 0;
    int r = zinf_lookup(e, name, &t);
    cr_assert_eq(r, 0, "lookup %s: %s", name, zinf_strerror(r));
    return t;
}

/* Both memory tiers see the same bytes too. */
static void expect_everywhere(zinf_engine *e, zinf_tensor t, const unsigned char *want, size_t n,
                              const char *what)
{
    test_expect_content(e, t, want, n, what);
    for (int tier = 0; tier < 2; tier++) {
        void *p;
        int r = zinf_fetch(e, t, tier, &p);
        cr_assert_eq(r, 0, "%s: fetch to %d: %s", what, tier, zinf_strerror(r));
        cr_assert_eq(memcmp(p, want, n), 0, "%s: tier %d", what, tier);
        cr_assert_eq(zinf_release(e, t, tier, 0), 0);
    }
}

static char *path_in(const char *d, const char *name)
{
    char *p;
    cr_assert_geq(asprintf(&p, "%s/%s", d, name), 0);
    return p;
}

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    cr_assert_not_null(buf);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static void spill(const char *path, const char *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(buf, 1, len, f), len);
    fclose(f);
}

/* ==== flush, close, resume ================================================================== */

struct spec {
    const char *name;
    size_t n;
    enum zinf_tier home;
    enum { NEVER_WRITTEN, BY_WRITE, DIRTY_DEVICE, DIRTY_HOST, DIRTY_DEVICE_PINNED_AT_FLUSH } how;
};

static const struct spec specs[] = {
    {"dev.zero", 10000, ZINF_TIER_DEVICE, NEVER_WRITTEN},
    {"dev.write", 70001, ZINF_TIER_DEVICE, BY_WRITE},
    {"dev.dirty_host", 4096, ZINF_TIER_DEVICE, DIRTY_HOST},
    {"host.zero", 1, ZINF_TIER_HOST, NEVER_WRITTEN},
    {"host.write", 5555, ZINF_TIER_HOST, BY_WRITE},
    {"host.dirty_device", 300 * KiB + 3, ZINF_TIER_HOST, DIRTY_DEVICE},
    {"nvme.zero", 200 * KiB + 1, ZINF_TIER_NVME, NEVER_WRITTEN},
    {"nvme.write", 1 * MiB + 7, ZINF_TIER_NVME, BY_WRITE},
    {"nvme.dirty_device", 3 * MiB + 11, ZINF_TIER_NVME, DIRTY_DEVICE},
    {"nvme.dirty_host", 123457, ZINF_TIER_NVME, DIRTY_HOST},
    {"nvme.dirty_pinned", 65536, ZINF_TIER_NVME, DIRTY_DEVICE_PINNED_AT_FLUSH},
};

static void fill_specs(zinf_engine *e, unsigned char **ref, uint64_t seed, zinf_tensor *pinned)
{
    for (size_t i = 0; i < ARRAY_SIZE(specs); i++) {
        const struct spec *s = &specs[i];
        zinf_tensor t = look(e, s->name);
        void *p;
        int tier = s->how == DIRTY_HOST ? ZINF_TIER_HOST : ZINF_TIER_DEVICE;
        test_fill_random(ref[i], s->n, seed + i);
        switch (s->how) {
        case NEVER_WRITTEN:
            memset(ref[i], 0, s->n);
            break;
        case BY_WRITE:
            cr_assert_eq(zinf_write(e, t, 0, ref[i], s->n), 0);
            break;
        case DIRTY_DEVICE:
        case DIRTY_HOST:
        case DIRTY_DEVICE_PINNED_AT_FLUSH:
            cr_assert_eq(zinf_fetch(e, t, tier, &p), 0, "%s", s->name);
            memcpy(p, ref[i], s->n);
            cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
            if (s->how == DIRTY_DEVICE_PINNED_AT_FLUSH) {
                cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
                *pinned = t;
            }
            break;
        }
    }
}

static void resume_round_trip(bool two_dirs)
{
    unsigned char *ref[ARRAY_SIZE(specs)];
    zinf_engine *e = open_eng(0, two_dirs);
    zinf_tensor pinned = 0;

    for (size_t i = 0; i < ARRAY_SIZE(specs); i++) {
        test_register(e, specs[i].name, specs[i].n, specs[i].home);
        ref[i] = malloc(specs[i].n);
    }
    /* Twice: the second flush replaces what the first one wrote. */
    for (int round = 0; round < 2; round++) {
        fill_specs(e, ref, 100 * (uint64_t)round, &pinned);
        int r = zinf_flush(e);
        cr_assert_eq(r, 0, "flush: %s", zinf_strerror(r));
        cr_assert_eq(zinf_release(e, pinned, ZINF_TIER_DEVICE, 0), 0);
    }
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.flushes, 2);
    /* The newest copy of some is still a dirty device copy: close writes it out. */
    fill_specs(e, ref, 1000, &pinned);
    cr_assert_eq(zinf_release(e, pinned, ZINF_TIER_DEVICE, 0), 0);
    zinf_close(e);

    for (int reopen = 0; reopen < 2; reopen++) {
        e = open_eng(ZINF_OPEN_RESUME, two_dirs);
        cr_assert_eq(zinf_stats(e, &st), 0);
        cr_assert_eq(st.tensors, ARRAY_SIZE(specs));
        for (size_t i = 0; i < ARRAY_SIZE(specs); i++)
            expect_everywhere(e, look(e, specs[i].name), ref[i], specs[i].n, specs[i].name);
        /* A resumed tensor keeps its home and size. */
        zinf_tensor x;
        cr_assert_eq(zinf_register(e, "dev.zero", 10, ZINF_TIER_HOST, &x), -EEXIST);
        cr_assert_eq(zinf_write(e, look(e, "host.zero"), 1, "x", 1), -EINVAL);
        zinf_close(e); /* a close without changes keeps everything as it was */
    }
    for (size_t i = 0; i < ARRAY_SIZE(specs); i++)
        free(ref[i]);
}

Test(persist, flush_close_resume_every_home)
{
    resume_round_trip(false);
}

Test(persist, flush_close_resume_two_directories)
{
    resume_round_trip(true);
    /* Both directories hold a swap file with data in it. */
    for (int i = 0; i < 2; i++) {
        char name[32];
        snprintf(name, sizeof(name), "zinf-swap.%d", i);
        char *p = path_in(i ? dir2 : dir, name);
        struct stat st;
        cr_assert_eq(stat(p, &st), 0, "%s", p);
        cr_assert_gt(st.st_size, 0);
        free(p);
    }
    /* The same directories in one: the striping differs, the resume is refused. */
    zinf_engine *e;
    test_log_capture_start();
    int r = open_at(ZINF_OPEN_RESUME, false, &e);
    cr_assert_lt(r, 0, "resume over a different set of directories");
    cr_assert_null(e);
    test_log_capture_stop();
}

Test(persist, resume_then_change_then_resume)
{
    const size_t n = 100 * KiB + 1;
    unsigned char *a = test_rand_buf(n, 1), *b = test_rand_buf(n, 2);
    zinf_engine *e = open_eng(0, false);
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_NVME), u = test_register(e, "u", n, ZINF_TIER_HOST);

    cr_assert_eq(zinf_write(e, t, 0, a, n), 0);
    cr_assert_eq(zinf_write(e, u, 0, a, n), 0);
    zinf_close(e);
    e = open_eng(ZINF_OPEN_RESUME, false);
    t = look(e, "t");
    u = look(e, "u");
    expect_everywhere(e, t, a, n, "t once");
    cr_assert_eq(zinf_write(e, t, 7, b, 1000), 0);
    memcpy(a + 7, b, 1000);
    void *p;
    cr_assert_eq(zinf_fetch(e, u, ZINF_TIER_DEVICE, &p), 0);
    memcpy(p, b, n);
    cr_assert_eq(zinf_release(e, u, ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    zinf_tensor v = test_register(e, "v", 33, ZINF_TIER_DEVICE);
    cr_assert_eq(zinf_write(e, v, 0, b, 33), 0);
    zinf_close(e);
    e = open_eng(ZINF_OPEN_RESUME, false);
    expect_everywhere(e, look(e, "t"), a, n, "t twice");
    expect_everywhere(e, look(e, "u"), b, n, "u twice");
    expect_everywhere(e, look(e, "v"), b, 33, "v");
    cr_assert_eq(zinf_unregister(e, look(e, "v")), 0);
    zinf_close(e);
    e = open_eng(ZINF_OPEN_RESUME, false);
    zinf_tensor x;
    cr_assert_eq(zinf_lookup(e, "v", &x), -ENOENT, "unregistered before the last close");
    test_expect_content(e, look(e, "t"), a, n, "t thrice");
    zinf_close(e);
    free(a);
    free(b);
}

Test(persist, reopen_with_overwrite_starts_empty)
{
    zinf_engine *e = open_eng(0, false);
    zinf_tensor t = test_register(e, "t", 5000, ZINF_TIER_NVME);
    cr_assert_eq(zinf_write(e, t, 0, "abc", 3), 0);
    cr_assert_eq(zinf_flush(e), 0);
    zinf_close(e);
    e = open_eng(ZINF_OPEN_OVERWRITE, false);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors, 0);
    cr_assert_eq(zinf_lookup(e, "t", &t), -ENOENT);
    /* The old name is free, and its content is gone: zeros. */
    t = test_register(e, "t", 5000, ZINF_TIER_NVME);
    unsigned char got[3];
    cr_assert_eq(zinf_read(e, t, 0, got, 3), 0);
    cr_assert(got[0] == 0 && got[1] == 0 && got[2] == 0);
    zinf_close(e);
    /* ... and that empty start is what a later resume finds (close flushed it). */
    e = open_eng(ZINF_OPEN_RESUME, false);
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors, 1);
    zinf_close(e);
    /* Resume with no manifest at all: there is no saved run to continue (test_swapdir.c). */
    test_rmtree(dir);
    dir = test_tmpdir("persist");
    test_log_capture_start();
    cr_assert_eq(open_at(ZINF_OPEN_RESUME, false, &e), -ENOENT);
    test_log_capture_stop();
}

/* The swap space does not grow with every flush: what an old manifest named is freed once
 * a newer one no longer names it. */
Test(persist, swap_space_reused_across_flushes)
{
    enum { N = 6 };
    const size_t n = 256 * KiB;
    unsigned char *a = test_rand_buf(n, 3);
    zinf_engine *e = open_eng(0, false);
    zinf_tensor t[N];
    struct zinf_stats st;

    for (int i = 0; i < N; i++) {
        char name[16];
        snprintf(name, sizeof(name), "t%d", i);
        t[i] = test_register(e, name, n,
                   i % 3 == 0   ? ZINF_TIER_NVME
                   : i % 3 == 1 ? ZINF_TIER_HOST
                                : ZINF_TIER_DEVICE);
    }
    cr_assert_eq(zinf_flush(e), 0); /* zeros */
    for (int round = 0; round < 8; round++) {
        for (int i = 0; i < N; i++) {
            a[round] = (unsigned char)(round + i);
            if (round % 2) {
                cr_assert_eq(zinf_write(e, t[i], 0, a, n), 0);
            } else {
                void *p;
                cr_assert_eq(zinf_fetch(e, t[i], ZINF_TIER_DEVICE, &p), 0);
                memcpy(p, a, n);
                cr_assert_eq(zinf_release(e, t[i], ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
            }
        }
        cr_assert_eq(zinf_flush(e), 0);
        cr_assert_eq(zinf_flush(e), 0, "a flush with nothing new");
        cr_assert_eq(zinf_stats(e, &st), 0);
        /* One extent per tensor, plus at most one more each while a write is pending. */
        cr_assert_leq(st.tier[ZINF_TIER_NVME].used_bytes, (uint64_t)N * n,
                      "round %d: %llu bytes of swap in use for %d tensors of %zu", round,
                      (unsigned long long)st.tier[ZINF_TIER_NVME].used_bytes, N, n);
    }
    for (int i = 0; i < N; i++)
        cr_assert_eq(zinf_unregister(e, t[i]), 0);
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tier[ZINF_TIER_NVME].used_bytes, 0, "unregistered and flushed: all free");
    zinf_close(e);
    free(a);
}

/* A tensor of a memory home never written is saved as zeros (no bytes in the swap files),
 * comes back as zeros, and unregistering it, fresh or resumed, frees nobody's extent: the
 * NVMe tensor beside it keeps its bytes through flushes and resumes. */
Test(persist, unwritten_memory_homes_are_saved_as_zeros_and_free_no_extent)
{
    const size_t n = 128 * KiB;
    unsigned char *a = test_rand_buf(n, 5), *z = calloc(1, n);
    zinf_engine *e = open_eng(0, false);
    struct zinf_stats st;
    zinf_tensor nv = test_register(e, "nv", n, ZINF_TIER_NVME);
    cr_assert_eq(zinf_write(e, nv, 0, a, n), 0);
    zinf_tensor h = test_register(e, "h", n, ZINF_TIER_HOST);
    zinf_tensor d = test_register(e, "d", n, ZINF_TIER_DEVICE);
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tier[ZINF_TIER_NVME].used_bytes, n, "only the written tensor has swap");
    cr_assert_eq(zinf_unregister(e, h), 0);
    cr_assert_eq(zinf_flush(e), 0);
    /* Swap space taken now must not be nv's. */
    zinf_tensor x = test_register(e, "x", n, ZINF_TIER_NVME);
    cr_assert_eq(zinf_write(e, x, 0, z, n), 0);
    cr_assert_eq(zinf_flush(e), 0);
    expect_everywhere(e, nv, a, n, "nv after h went");
    zinf_close(e);

    e = open_eng(ZINF_OPEN_RESUME, false);
    nv = look(e, "nv");
    d = look(e, "d");
    expect_everywhere(e, d, z, n, "d resumed");
    cr_assert_eq(zinf_unregister(e, d), 0);
    cr_assert_eq(zinf_flush(e), 0);
    zinf_tensor y = test_register(e, "y", n, ZINF_TIER_NVME);
    cr_assert_eq(zinf_write(e, y, 0, z, n), 0);
    cr_assert_eq(zinf_flush(e), 0);
    expect_everywhere(e, nv, a, n, "nv after d went");
    zinf_close(e);
    e = open_eng(ZINF_OPEN_RESUME, false);
    expect_everywhere(e, look(e, "nv"), a, n, "nv resumed");
    zinf_close(e);
    free(a);
    free(z);
}

/* Put version seed of the three tensors "t" (NVMe), "u" (host) and "d" (device) in place by
 * three different paths. */
static void write_tud(zinf_engine *e, unsigned char **ref, const size_t *n, uint64_t seed)
{
    void *p;
    for (int i = 0; i < 3; i++)
        test_fill_random(ref[i], n[i], seed + i);
    cr_assert_eq(zinf_fetch(e, look(e, "t"), ZINF_TIER_DEVICE, &p), 0);
    memcpy(p, ref[0], n[0]);
    cr_assert_eq(zinf_release(e, look(e, "t"), ZINF_TIER_DEVICE, ZINF_RELEASE_DIRTY), 0);
    cr_assert_eq(zinf_write(e, look(e, "u"), 0, ref[1], n[1]), 0);
    cr_assert_eq(zinf_fetch(e, look(e, "d"), ZINF_TIER_HOST, &p), 0);
    memcpy(p, ref[2], n[2]);
    cr_assert_eq(zinf_release(e, look(e, "d"), ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);
}

/* A flush that fails leaves the previous manifest committed and whole: a crash right after
 * it resumes the previous content; a later flush succeeds and frees what the failed one
 * wrote. */
Test(persist, failed_flush_keeps_the_previous_manifest)
{
    const size_t n[3] = {300 * KiB + 1, 70001, 5000};
    unsigned char *a[3], *b[3];
    for (int i = 0; i < 3; i++) {
        a[i] = malloc(n[i]);
        b[i] = malloc(n[i]);
    }
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        zinf_engine *e;
        if (open_at(0, false, &e) < 0) _exit(2);
        zinf_tensor x;
        if (zinf_register(e, "t", n[0], ZINF_TIER_NVME, &x) ||
            zinf_register(e, "u", n[1], ZINF_TIER_HOST, &x) ||
            zinf_register(e, "d", n[2], ZINF_TIER_DEVICE, &x))
            _exit(3);
        write_tud(e, a, n, 10);
        if (zinf_flush(e) != 0) _exit(4);
        write_tud(e, b, n, 20);
        for (unsigned nth = 1; nth <= 3; nth++) {
            uring_fault_set(e->io, URING_FAULT_EIO, nth);
            if (zinf_flush(e) != -EIO) _exit(5);
        }
        _exit(0); /* a crash: no close */
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %#x", status);
    for (int i = 0; i < 3; i++) /* what the child wrote: same seeds */
        test_fill_random(a[i], n[i], 10 + i);

    zinf_engine *e;
    int r, busy_ms = 0;
    while ((r = open_at(ZINF_OPEN_RESUME, false, &e)) == -EBUSY && busy_ms++ < 5000)
        usleep(1000);
    cr_assert_eq(r, 0, "resume: %s", zinf_strerror(r));
    const char *names[3] = {"t", "u", "d"};
    for (int i = 0; i < 3; i++)
        expect_everywhere(e, look(e, names[i]), a[i], n[i], names[i]);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    uint64_t used0 = st.tier[ZINF_TIER_NVME].used_bytes;

    /* The same in one process: failed flushes, then one that works. */
    write_tud(e, b, n, 30);
    for (unsigned nth = 1; nth <= 3; nth++) {
        uring_fault_set(e->io, URING_FAULT_EIO, nth);
        cr_assert_eq(zinf_flush(e), -EIO);
        for (int i = 0; i < 3; i++)
            test_expect_content(e, look(e, names[i]), b[i], n[i], names[i]);
    }
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tier[ZINF_TIER_NVME].used_bytes, used0,
                 "the failed flushes' extents are free again: %llu bytes used, %llu before",
                 (unsigned long long)st.tier[ZINF_TIER_NVME].used_bytes, (unsigned long long)used0);
    zinf_close(e);
    e = open_eng(ZINF_OPEN_RESUME, false);
    for (int i = 0; i < 3; i++) {
        expect_everywhere(e, look(e, names[i]), b[i], n[i], names[i]);
        free(a[i]);
        free(b[i]);
    }
    zinf_close(e);
}

/* ==== corruption ============================================================================== */

/* Find needle in the swap file and flip one byte of it there. */
static void flip_byte_in_swap(const char *d, const unsigned char *needle, size_t len, size_t at)
{
    char *p = path_in(d, "zinf-swap.0");
    size_t n;
    char *buf = slurp(p, &n);
    char *hit = memmem(buf, n, needle, len);
    cr_assert_not_null(hit, "the pattern is in %s", p);
    cr_assert_null(memmem(hit + 1, n - (size_t)(hit + 1 - buf), needle, len),
                   "and only once (an old copy would make this test ambiguous)");
    int fd = open(p, O_WRONLY);
    cr_assert_geq(fd, 0);
    char c = (char)(hit[at] ^ 0x40);
    cr_assert_eq(pwrite(fd, &c, 1, (off_t)(hit - buf) + (off_t)at), 1);
    close(fd);
    free(buf);
    free(p);
}

/* A flipped byte in one tensor's saved content: the resume names that tensor, marks it
 * damaged (-EBADMSG from fetch and read) and brings every other tensor back. Nothing on
 * disk is lost: flushing and resuming again keeps the damaged entry as it was, and once the
 * byte is mended the tensor comes back whole. */
static void flipped_byte_is_caught(enum zinf_tier home)
{
    const size_t n = 150 * KiB + 9;
    unsigned char *a = test_rand_buf(n, 7 + home), *b = test_rand_buf(n, 17);
    zinf_engine *e = open_eng(0, false);
    zinf_tensor ok = test_register(e, "fine", n, ZINF_TIER_NVME);
    zinf_tensor t = test_register(e, "victim", n, home);
    void *p;

    cr_assert_eq(zinf_write(e, ok, 0, b, n), 0);
    cr_assert_eq(zinf_write(e, t, 0, a, n), 0);
    zinf_close(e);
    flip_byte_in_swap(dir, a + 1000, 64, 31);

    for (int round = 0; round < 2; round++) {
        test_log_capture_start();
        e = open_eng(ZINF_OPEN_RESUME, false);
        const char *log = test_log_text();
        cr_assert(strstr(log, "'victim'") && strstr(log, "checksum"),
                  "round %d: the log names the tensor: %s", round, log);
        cr_assert_null(strstr(log, "'fine'"), "and only it: %s", log);
        test_log_capture_stop();
        struct zinf_stats st;
        cr_assert_eq(zinf_stats(e, &st), 0);
        cr_assert_eq(st.tensors_damaged, 1);
        test_expect_content(e, look(e, "fine"), b, n, "the undamaged tensor");
        t = look(e, "victim");
        unsigned char one;
        cr_assert_eq(zinf_read(e, t, 0, &one, 1), -EBADMSG, "home %d", home);
        cr_assert_eq(zinf_write(e, t, 0, a, 1), -EBADMSG);
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), -EBADMSG);
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_DEVICE, &p), -EBADMSG);
        cr_assert_eq(zinf_prefetch(e, t, ZINF_TIER_DEVICE), -EBADMSG);
        zinf_close(e); /* flushes: the damaged entry must survive it */
    }
    unsigned char torn[64];
    memcpy(torn, a + 1000, sizeof(torn));
    torn[31] ^= 0x40;
    flip_byte_in_swap(dir, torn, sizeof(torn), 31); /* mend it */
    e = open_eng(ZINF_OPEN_RESUME, false);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors_damaged, 0);
    test_expect_content(e, look(e, "victim"), a, n, "the mended tensor");
    test_expect_content(e, look(e, "fine"), b, n, "the undamaged tensor");
    zinf_close(e);
    free(a);
    free(b);
}

Test(persist, flipped_byte_nvme_home_is_ebadmsg)
{
    flipped_byte_is_caught(ZINF_TIER_NVME);
}

Test(persist, flipped_byte_host_home_is_ebadmsg)
{
    flipped_byte_is_caught(ZINF_TIER_HOST);
}

Test(persist, flipped_byte_device_home_is_ebadmsg)
{
    flipped_byte_is_caught(ZINF_TIER_DEVICE);
}

/* What a crash at this moment would leave: the swap directory's files copied elsewhere,
 * opened there with RESUME (the engine that wrote them stays open). */
static zinf_engine *resume_snapshot(void)
{
    char *snap = test_tmpdir("persist-snap");
    char cmd[8192];
    snprintf(cmd, sizeof(cmd), "cp -a '%s'/. '%s'/", dir, snap);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    char *saved = dir;
    dir = snap;
    zinf_engine *e = open_eng(ZINF_OPEN_RESUME, false);
    dir = saved;
    snapshot_dir = snap;
    return e;
}

static void snapshot_close(zinf_engine *e)
{
    zinf_close(e);
    test_rmtree(snapshot_dir);
    snapshot_dir = NULL;
}

struct scribbler {
    unsigned char *p;
    size_t n;
    atomic_bool stop;
};

static void *scribble(void *arg)
{
    struct scribbler *s = arg;
    for (unsigned v = 1; !atomic_load(&s->stop); v++)
        memset(s->p, (int)(v & 0xff), s->n);
    return NULL;
}

/* A caller writes through its pinned pointer while zinf_flush runs. The flush checksummed
 * the host copy before the asynchronous write read it, so the manifest's checksum matched
 * nothing and the resume refused everything. The checksum must be of the bytes written. */
Test(persist, flush_of_a_tensor_written_through_its_pin_checksums_what_it_wrote)
{
    const size_t n = 4 * MiB;
    unsigned char *b = test_rand_buf(64 * KiB, 3);
    zinf_engine *e = open_eng(0, false);
    zinf_tensor t = test_register(e, "busy", n, ZINF_TIER_NVME);
    zinf_tensor other = test_register(e, "other", 64 * KiB, ZINF_TIER_NVME);
    void *p;

    cr_assert_eq(zinf_write(e, other, 0, b, 64 * KiB), 0);
    for (int round = 0; round < 3; round++) {
        cr_assert_eq(zinf_fetch(e, t, ZINF_TIER_HOST, &p), 0);
        struct scribbler s = {.p = p, .n = n};
        pthread_t th;
        cr_assert_eq(pthread_create(&th, NULL, scribble, &s), 0);
        usleep(1000);
        int r = zinf_flush(e);
        atomic_store(&s.stop, true);
        pthread_join(th, NULL);
        cr_assert_eq(r, 0, "flush: %s", zinf_strerror(r));
        cr_assert_eq(zinf_release(e, t, ZINF_TIER_HOST, ZINF_RELEASE_DIRTY), 0);

        zinf_engine *s2 = resume_snapshot();
        struct zinf_stats st;
        cr_assert_eq(zinf_stats(s2, &st), 0);
        cr_assert_eq(st.tensors_damaged, 0, "round %d: the flushed bytes match their checksum",
                     round);
        test_expect_content(s2, look(s2, "other"), b, 64 * KiB, "the other tensor");
        snapshot_close(s2);
    }
    zinf_close(e);
    free(b);
}

/* A caller holds a tensor's only newest copy and has written half of a new version through
 * its pin when a flush begins on another thread; 50 ms later it writes the rest and releases
 * it DIRTY. The flush waits for that release and saves the new version whole: it used to
 * read the copy at once and save the half-written bytes under the older version's label (a
 * crash then resumed a torn tensor). A flush by the thread that holds the pin itself, not
 * writing through it meanwhile, waits its 200 ms and saves what the pin holds. Every home. */
struct flusher {
    zinf_engine *e;
    int r;
    atomic_bool done;
};

static void *flush_in_thread(void *arg)
{
    struct flusher *f = arg;
    f->r = zinf_flush(f->e);
    atomic_store(&f->done, true);
    return NULL;
}

Test(persist, a_flush_waits_for_a_writer_to_release_the_only_newest_copy)
{
    const size_t n = 300 * KiB + 3;
    enum zinf_tier homes[] = {ZINF_TIER_DEVICE, ZINF_TIER_HOST, ZINF_TIER_NVME};
    unsigned char *v[5];
    for (int k = 0; k < 5; k++)
        v[k] = test_rand_buf(n, 40 + k);
    for (size_t h = 0; h < ARRAY_SIZE(homes); h++) {
        zinf_engine *e = open_eng(ZINF_OPEN_OVERWRITE, false);
        zinf_tensor t = test_register(e, "held", n, homes[h]);
        int tier = homes[h] == ZINF_TIER_NVME ? ZINF_TIER_HOST : (int)homes[h];
        void *p;
        cr_assert_eq(zinf_write(e, t, 0, v[1], n), 0);
        cr_assert_eq(zinf_flush(e), 0);
        /* Version 2, released and not saved yet; then half of version 3 through the pin. */
        cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
        memcpy(p, v[2], n);
        cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
        cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
        memcpy(p, v[3], n / 2);
        struct flusher f = {.e = e};
        pthread_t th;
        cr_assert_eq(pthread_create(&th, NULL, flush_in_thread, &f), 0);
        usleep(50 * 1000);
        cr_assert(!atomic_load(&f.done), "home %d: the flush did not wait for the writer",
                  homes[h]);
        memcpy((char *)p + n / 2, v[3] + n / 2, n - n / 2);
        cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
        pthread_join(th, NULL);
        cr_assert_eq(f.r, 0, "flush: %s", zinf_strerror(f.r));
        zinf_engine *s = resume_snapshot();
        test_expect_content(s, look(s, "held"), v[3], n, "the version released during the flush");
        snapshot_close(s);

        /* The flushing thread's own pin: version 4 saved as the pin holds it. */
        cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
        memcpy(p, v[4], n);
        cr_assert_eq(zinf_release(e, t, tier, ZINF_RELEASE_DIRTY), 0);
        cr_assert_eq(zinf_fetch(e, t, tier, &p), 0);
        uint64_t t0 = now_ns();
        cr_assert_eq(zinf_flush(e), 0);
        cr_assert_geq(now_ns() - t0, 190 * 1000000ull, "home %d: no wait for the pin", homes[h]);
        cr_assert_eq(zinf_release(e, t, tier, 0), 0);
        s = resume_snapshot();
        test_expect_content(s, look(s, "held"), v[4], n, "a flush under its own pin");
        snapshot_close(s);
        zinf_close(e);
    }
    for (int k = 0; k < 5; k++)
        free(v[k]);
}

/* fsync of the directory failing after rename() put the new manifest in place was taken
 * for "manifest abandoned": the next write went in place into the extent the manifest on
 * disk names, and a crash then left neither version. Now that manifest counts as the saved
 * state (and the one before it is kept too, as a crash may bring it back): a crash at any
 * later moment leaves one whole version. */
Test(persist, dir_fsync_failing_after_the_rename_keeps_both_manifests_whole)
{
    const size_t n = 200 * KiB + 5;
    unsigned char *a = test_rand_buf(n, 41), *b = test_rand_buf(n, 42), *c = test_rand_buf(n, 43);
    zinf_engine *e = open_eng(0, false);
    zinf_tensor t = test_register(e, "t", n, ZINF_TIER_NVME);

    cr_assert_eq(zinf_write(e, t, 0, a, n), 0);
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(zinf_write(e, t, 0, b, n), 0);
    e->fault_dir_fsync = -EIO;
    test_log_capture_start();
    cr_assert_eq(zinf_flush(e), -EIO, "the failed directory sync is reported");
    cr_assert(strstr(test_log_text(), "syncing its directory"), "%s", test_log_text());
    test_log_capture_stop();

    /* The manifest in place names b; a crash may also bring back the one naming a. */
    zinf_engine *s = resume_snapshot();
    test_expect_content(s, look(s, "t"), b, n, "after the failed directory sync");
    snapshot_close(s);

    /* Later writes must touch neither extent. */
    cr_assert_eq(zinf_write(e, t, 0, c, n), 0);
    s = resume_snapshot();
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(s, &st), 0);
    cr_assert_eq(st.tensors_damaged, 0, "the manifest's extent was not overwritten");
    test_expect_content(s, look(s, "t"), b, n, "a crash after a later write");
    snapshot_close(s);

    /* The engine goes on: the next flush completes and names c. */
    cr_assert_eq(zinf_flush(e), 0);
    test_expect_content(e, t, c, n, "the engine itself");
    zinf_close(e);
    e = open_eng(ZINF_OPEN_RESUME, false);
    test_expect_content(e, look(e, "t"), c, n, "after a completed flush");
    zinf_close(e);
    free(a);
    free(b);
    free(c);
}

/* Write a manifest from a good one with one change, and check the resume refuses it. */
static void expect_refused(const char *text, size_t len, const char *what)
{
    char *p = path_in(dir, MANIFEST);
    spill(p, text, len);
    free(p);
    zinf_engine *e = (zinf_engine *)1;
    test_log_capture_start();
    int r = open_at(ZINF_OPEN_RESUME, false, &e);
    cr_assert_lt(r, 0, "%s: resume accepted it", what);
    cr_assert_null(e, "%s", what);
    cr_assert_neq(test_log_text()[0], '\0', "%s: nothing logged", what);
    test_log_capture_stop();
}

static char *replace(const char *s, const char *from, const char *to)
{
    const char *hit = strstr(s, from);
    cr_assert_not_null(hit, "'%s' in the manifest", from);
    char *out;
    cr_assert_geq(asprintf(&out, "%.*s%s%s", (int)(hit - s), s, to, hit + strlen(from)), 0);
    return out;
}

Test(persist, corrupt_or_truncated_manifest_is_refused)
{
    const size_t n = 20000;
    unsigned char *a = test_rand_buf(n, 9);
    zinf_engine *e = open_eng(0, false);
    test_register(e, "a", n, ZINF_TIER_NVME);
    test_register(e, "b", n, ZINF_TIER_HOST);
    cr_assert_eq(zinf_write(e, look(e, "a"), 0, a, n), 0);
    cr_assert_eq(zinf_write(e, look(e, "b"), 0, a, n), 0);
    zinf_close(e);

    char *mp = path_in(dir, MANIFEST);
    size_t len;
    char *good = slurp(mp, &len);

    /* Truncated at many points, including empty. */
    for (size_t cut = 0; cut < len; cut += 1 + len / 23)
        expect_refused(good, cut, "truncated");
    expect_refused("garbage\n", 8, "not JSON");
    expect_refused("[]", 2, "not an object");
    expect_refused("{}", 2, "no fields");
    struct {
        const char *from, *to, *what;
    } edits[] = {
        {"\"zinf-manifest\"", "\"other\"", "format"},
        {"\"version\": 1", "\"version\": 99", "version"},
        {"\"block_size\": 65536", "\"block_size\": 131072", "block size"},
        {"\"dirs\": 1", "\"dirs\": 2", "directory count"},
        {"\"nbytes\": 20000", "\"nbytes\": -5", "negative size"},
        {"\"nbytes\": 20000", "\"nbytes\": \"big\"", "size not a number"},
        {"\"nbytes\": 20000", "\"nbytes\": 4611686018427387904", "huge size"},
        {"\"home\": \"nvme\"", "\"home\": \"gpu\"", "unknown home"},
        {"\"offset\": ", "\"offset\": 1234567890123, \"x\": ", "offset past the files"},
        {"\"offset\": ", "\"offset\": 100, \"x\": ", "unaligned offset"},
        {"\"tensors\": [", "\"tensors\": [7, ", "an entry that is not an object"},
        {"\"name\": \"a\"", "\"nom\": \"a\"", "no name"},
        {"\"name\": \"b\"", "\"name\": \"a\"", "a name twice"},
        {"\"zero\": false", "\"zero\": 3", "zero not a boolean"},
        /* A checksum that does not match is not a bad manifest: that tensor alone is
         * marked damaged (flipped_byte_* below). */
    };
    for (size_t i = 0; i < ARRAY_SIZE(edits); i++) {
        char *bad = replace(good, edits[i].from, edits[i].to);
        expect_refused(bad, strlen(bad), edits[i].what);
        free(bad);
    }
    /* The good manifest still works after all that. */
    spill(mp, good, len);
    e = open_eng(ZINF_OPEN_RESUME, false);
    test_expect_content(e, look(e, "a"), a, n, "a");
    test_expect_content(e, look(e, "b"), a, n, "b");
    zinf_close(e);
    free(good);
    free(mp);
    free(a);
}

Test(persist, missing_swap_file_is_refused)
{
    zinf_engine *e = open_eng(0, true);
    test_register(e, "a", 300 * KiB, ZINF_TIER_NVME);
    cr_assert_eq(zinf_write(e, look(e, "a"), 0, "x", 1), 0);
    zinf_close(e);
    char *p = path_in(dir2, "zinf-swap.1");
    cr_assert_eq(unlink(p), 0, "%s", p);
    free(p);
    test_log_capture_start();
    int r = open_at(ZINF_OPEN_RESUME, true, &e);
    cr_assert_lt(r, 0);
    cr_assert_null(e);
    test_log_capture_stop();
}

/* ==== killed at a random moment ================================================================
 */

#define CRASH_TENSORS 8

struct crash_tensor {
    const char *name;
    size_t n;
    enum zinf_tier home;
};

static const struct crash_tensor crash_set[CRASH_TENSORS] = {
    {"c.dev", 70001, ZINF_TIER_DEVICE},         {"c.host", 5000, ZINF_TIER_HOST},
    {"c.host2", 200 * KiB + 1, ZINF_TIER_HOST}, {"c.nvme.small", 13, ZINF_TIER_NVME},
    {"c.nvme", 300 * KiB + 7, ZINF_TIER_NVME},  {"c.nvme.big", 1 * MiB + 3, ZINF_TIER_NVME},
    {"c.nvme.page", 4096, ZINF_TIER_NVME},      {"c.dev2", 8192 + 1, ZINF_TIER_DEVICE},
};

/* Version v of tensor i: v == 0 is zeros, else pseudo-random bytes from (i, v). */
static void version_bytes(unsigned i, uint64_t v, unsigned char *buf, size_t n)
{
    if (v == 0)
        memset(buf, 0, n);
    else
        test_fill_random(buf, n, (uint64_t)i * 1000003u + v * 7919u);
}

struct crash_shared {
    atomic_uint_fast64_t written; /* the highest version the child started writing */
};

/* Write version v of tensor i, by one of several paths; with swap_only, NVMe tensors are
 * only written with zinf_write, so that they have no copy in memory and the bytes go to
 * their swap extent. */
static int child_write(zinf_engine *e, zinf_tensor t, unsigned i, uint64_t v, unsigned char *buf,
                       bool swap_only)
{
    size_t n = crash_set[i].n;
    version_bytes(i, v, buf, n);
    switch (swap_only && crash_set[i].home == ZINF_TIER_NVME ? 0 : (v + i) % 3) {
    case 0:
        return zinf_write(e, t, 0, buf, n);
    default: {
        int tier = (v + i) % 3 == 1 ? ZINF_TIER_DEVICE : ZINF_TIER_HOST;
        void *p;
        int r = zinf_fetch(e, t, tier, &p);
        if (r < 0) return r;
        memcpy(p, buf, n);
        return zinf_release(e, t, tier, ZINF_RELEASE_DIRTY);
    }
    }
}

struct crash_child {
    zinf_engine *e;
    zinf_tensor t[CRASH_TENSORS];
    struct crash_shared *sh;
    unsigned char *buf;
};

static void *child_flusher(void *arg)
{
    struct crash_child *c = arg;
    for (;;)
        if (zinf_flush(c->e) < 0) _exit(5);
    return NULL;
}

/* The child: version 1 of everything flushed, then versions 2, 3, ... each written whole
 * and flushed, until it is killed. With concurrent, a second thread flushes all the time
 * while the versions are written, so flushes catch tensors mid-step. */
static void crash_child(int fd, struct crash_shared *sh, bool concurrent)
{
    struct crash_child c = {.sh = sh};
    if (open_at(ZINF_OPEN_OVERWRITE, false, &c.e) < 0) _exit(2);
    c.buf = malloc(2 * MiB);
    for (unsigned i = 0; i < CRASH_TENSORS; i++)
        if (!c.buf ||
            zinf_register(c.e, crash_set[i].name, crash_set[i].n, crash_set[i].home, &c.t[i]) < 0)
            _exit(3);
    atomic_store(&sh->written, 1);
    for (unsigned i = 0; i < CRASH_TENSORS; i++)
        if (child_write(c.e, c.t[i], i, 1, c.buf, concurrent) < 0) _exit(4);
    if (zinf_flush(c.e) < 0) _exit(5);
    if (write(fd, "A", 1) != 1) _exit(6);
    pthread_t th;
    if (concurrent && pthread_create(&th, NULL, child_flusher, &c) != 0) _exit(7);
    for (uint64_t v = 2;; v++) {
        atomic_store(&sh->written, v);
        for (unsigned i = 0; i < CRASH_TENSORS; i++)
            if (child_write(c.e, c.t[i], i, v, c.buf, concurrent) < 0) _exit(8);
        if (!concurrent && zinf_flush(c.e) < 0) _exit(5);
    }
}

/* Which version does tensor i hold? Every byte must come from the same one. */
static uint64_t whole_version(unsigned i, const unsigned char *got, uint64_t maxv)
{
    size_t n = crash_set[i].n;
    unsigned char *want = malloc(n);
    cr_assert_not_null(want);
    for (uint64_t v = 0; v <= maxv; v++) {
        version_bytes(i, v, want, n);
        if (!memcmp(got, want, MIN(n, 16))) {
            for (size_t k = 0; k < n; k++)
                if (got[k] != want[k]) {
                    /* Which version is this byte from? */
                    uint64_t other = UINT64_MAX;
                    for (uint64_t w = 0; w <= maxv && other == UINT64_MAX; w++) {
                        version_bytes(i, w, want, n);
                        if (got[k] == want[k] && w != v) other = w;
                    }
                    free(want);
                    cr_assert_fail("tensor %s: starts as version %llu, byte %zu of %zu differs "
                                   "(it matches version %lld): a torn tensor",
                                   crash_set[i].name, (unsigned long long)v, k, n,
                                   other == UINT64_MAX ? -1ll : (long long)other);
                }
            free(want);
            return v;
        }
    }
    free(want);
    cr_assert_fail("tensor %s holds no version from 0 to %llu", crash_set[i].name,
                   (unsigned long long)maxv);
    return 0;
}

static void crash_rounds(bool concurrent, unsigned rounds)
{
    struct crash_shared *sh =
        mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(sh, MAP_FAILED);
    uint64_t seed = (uint64_t)time(NULL);
    cr_log_info("crash rounds: seed %llu", (unsigned long long)seed);
    unsigned char *buf = malloc(2 * MiB);

    for (unsigned round = 0; round < rounds; round++) {
        /* Delays spread over 0-200 ms, in a different order each run. */
        unsigned delay_us =
            (unsigned)((round * 200000u / rounds + test_rand(&seed) % (200000u / rounds)));
        int fds[2];
        cr_assert_eq(pipe(fds), 0);
        atomic_store(&sh->written, 0);
        fflush(NULL);
        pid_t pid = fork();
        cr_assert_geq(pid, 0);
        if (pid == 0) {
            close(fds[0]);
            crash_child(fds[1], sh, concurrent);
            _exit(0);
        }
        close(fds[1]);
        char c;
        ssize_t got = read(fds[0], &c, 1);
        close(fds[0]);
        if (got != 1) {
            int status;
            waitpid(pid, &status, 0);
            cr_assert_fail("round %u: the child died before its first flush (status %#x)", round,
                           status);
        }
        usleep(delay_us);
        kill(pid, SIGKILL);
        int status;
        cr_assert_eq(waitpid(pid, &status, 0), pid);
        cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
                  "round %u: the child exited by itself (status %#x)", round, status);
        uint64_t maxv = atomic_load(&sh->written);

        zinf_engine *e;
        test_log_capture_start();
        /* The killed process's io_uring is torn down after it is reaped, and holds the swap
         * files (and their lock) until then: -EBUSY for a moment. */
        int r, busy_ms = 0;
        while ((r = open_at(ZINF_OPEN_RESUME, false, &e)) == -EBUSY && busy_ms < 5000) {
            usleep(1000);
            busy_ms++;
        }
        if (busy_ms)
            cr_log_info("round %u: the swap file stayed locked %d ms after the kill", round,
                        busy_ms);
        cr_assert_eq(r, 0, "round %u (killed after %u us, version %llu): resume: %s\n%s", round,
                     delay_us, (unsigned long long)maxv, zinf_strerror(r), test_log_text());
        test_log_capture_stop();
        uint64_t first = 0;
        for (unsigned i = 0; i < CRASH_TENSORS; i++) {
            zinf_tensor t = look(e, crash_set[i].name);
            r = zinf_read(e, t, 0, buf, crash_set[i].n);
            cr_assert_eq(r, 0, "%s", zinf_strerror(r));
            uint64_t v = whole_version(i, buf, maxv);
            cr_assert_geq(v, 1, "round %u: %s lost the flushed version 1", round,
                          crash_set[i].name);
            if (i == 0)
                first = v;
            else if (!concurrent)
                cr_assert_eq(v, first,
                             "round %u: one manifest holds one step: %s at %llu, "
                             "%s at %llu",
                             round, crash_set[0].name, (unsigned long long)first, crash_set[i].name,
                             (unsigned long long)v);
        }
        cr_log_info("round %u: killed after %u us while writing version %llu; resumed at %llu",
                    round, delay_us, (unsigned long long)maxv, (unsigned long long)first);
        zinf_close(e);
    }
    free(buf);
    munmap(sh, sizeof(*sh));
}

Test(persist, sigkill_at_a_random_moment_leaves_whole_versions)
{
    crash_rounds(false, 8);
}

Test(persist, sigkill_while_flushing_concurrently_leaves_whole_versions)
{
    crash_rounds(true, 8);
}

/* ---- two versions (persist_flush_tagged with keep) ---------------------------------- */

static int open_prev(unsigned flags, zinf_engine **e)
{
    struct zinf_options o = {.nvme_path = dir, .device_bytes = 8 * MiB, .host_bytes = 4 * MiB,
                             .block_size = BLOCK, .queue_depth = QD,
                             .device_kind = ZINF_DEVICE_EMULATED, .flags = flags};
    struct engine_params p = {.pin = false};
    *e = NULL;
    return engine_open(&o, &p, e);
}

static void expect_tags(int64_t cur, int64_t prev, const char *what)
{
    int64_t tags[2];
    cr_assert_eq(persist_versions(dir, tags), 0, "%s", what);
    cr_assert(tags[0] == cur && tags[1] == prev, "%s: tags %lld, %lld; want %lld, %lld", what,
              (long long)tags[0], (long long)tags[1], (long long)cur, (long long)prev);
}

/* Three tensors (one of each home), each filled with byte v. */
static void fill_all(zinf_engine *e, zinf_tensor *t, size_t n, unsigned char v)
{
    unsigned char *b = malloc(n);
    memset(b, v, n);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(zinf_write(e, t[i], 0, b, n), 0);
    free(b);
}

static void expect_all(zinf_engine *e, size_t n, unsigned char v, const char *what)
{
    unsigned char *b = malloc(n);
    memset(b, v, n);
    const char *names[3] = {"nv", "ho", "de"};
    for (int i = 0; i < 3; i++)
        expect_everywhere(e, look(e, names[i]), b, n, what);
    free(b);
}

/* A new engine with three tensors "nv", "ho" and "de" (one of each home) of n bytes v,
 * flushed keeping versions, tagged tag. */
static zinf_engine *three_saved(size_t n, unsigned char v, int64_t tag, zinf_tensor *t)
{
    zinf_engine *e;
    cr_assert_eq(open_prev(0, &e), 0);
    t[0] = test_register(e, "nv", n, ZINF_TIER_NVME);
    t[1] = test_register(e, "ho", n, ZINF_TIER_HOST);
    t[2] = test_register(e, "de", n, ZINF_TIER_DEVICE);
    fill_all(e, t, n, v);
    cr_assert_eq(engine_flush_tagged(e, tag, true), 0);
    return e;
}

/* A flush that keeps the previous version leaves two manifests, each with its tag and its
 * bytes: the previous one reads back as it was (read-only, changing nothing), writes made
 * after it never touch its extents, and going back to it makes it the current one. A
 * normal resume forgets it. At most two versions: a third flush drops the first. */
Test(persist, a_kept_previous_version_holds_its_bytes_until_dropped)
{
    const size_t n = 200 * KiB;
    zinf_tensor t[3];
    zinf_engine *e = three_saved(n, 1, 1, t);
    expect_tags(1, -1, "one version");
    fill_all(e, t, n, 2);
    cr_assert_eq(engine_flush_tagged(e, 2, true), 0);
    expect_tags(2, 1, "two versions");
    fill_all(e, t, n, 3); /* not flushed: must not reach version 1's or 2's extents */
    for (int i = 0; i < 3; i++) {
        void *p;
        cr_assert_eq(zinf_fetch(e, t[i], ZINF_TIER_HOST, &p), 0);
        cr_assert_eq(zinf_release(e, t[i], ZINF_TIER_HOST, 0), 0);
    }
    api_close_unflushed(e); /* as a crash would leave it */

    zinf_engine *r;
    cr_assert_eq(open_prev(ZINF_OPEN_READONLY | ENGINE_OPEN_PREVIOUS, &r), 0);
    expect_all(r, n, 1, "the previous version, read-only");
    zinf_close(r);
    cr_assert_eq(open_prev(ZINF_OPEN_READONLY, &r), 0);
    expect_all(r, n, 2, "the current version, read-only");
    zinf_close(r);
    expect_tags(2, 1, "read-only changed nothing");

    /* Going back: version 1 is the current one, version 2 is gone. */
    cr_assert_eq(open_prev(ZINF_OPEN_RESUME | ENGINE_OPEN_PREVIOUS, &r), 0);
    expect_all(r, n, 1, "rolled back");
    expect_tags(1, -1, "rolled back");
    zinf_tensor u[3] = {look(r, "nv"), look(r, "ho"), look(r, "de")};
    fill_all(r, u, n, 4);
    cr_assert_eq(engine_flush_tagged(r, 2, true), 0);
    fill_all(r, u, n, 5);
    cr_assert_eq(engine_flush_tagged(r, 3, true), 0);
    expect_tags(3, 2, "two again, the first dropped");
    cr_assert_eq(engine_drop_previous(r), 0);
    expect_tags(3, -1, "dropped");
    zinf_close(r); /* an unchanged state: the plain flush keeps the tag */
    expect_tags(3, -1, "closed unchanged");

    cr_assert_eq(open_prev(ZINF_OPEN_RESUME, &r), 0);
    expect_all(r, n, 5, "resumed");
    cr_assert_eq(open_prev(ZINF_OPEN_READONLY | ENGINE_OPEN_PREVIOUS, &e), 0,
                 "with no previous version, the current one is read");
    zinf_close(e);
    fill_all(r, u, n, 6);
    zinf_close(r); /* changed: a plain flush's manifest has no tag */
    expect_tags(-1, -1, "changed by a plain flush");
    /* Not the caller's flag. */
    struct zinf_options o = {.nvme_path = dir, .flags = ZINF_OPEN_RESUME | ENGINE_OPEN_PREVIOUS};
    cr_assert_eq(zinf_open(&o, &e), -EINVAL);
}

/* The same versions through the public calls alone: zinf_flush_step keeps the previous
 * version, zinf_saved_steps/_at/_tensors read the directory without an engine,
 * ZINF_OPEN_PREVIOUS opens the kept version, zinf_drop_previous forgets it; each refuses
 * what it must (bad input -EINVAL, a READONLY engine -EROFS, no saved state -ENOENT). */
Test(persist, versions_through_the_public_calls)
{
    const size_t n = 100 * KiB;
    int64_t steps[2], ns;
    size_t count;
    char *none = path_in(dir, "none");
    cr_assert_eq(zinf_saved_steps(dir, steps), -ENOENT, "nothing saved yet");
    cr_assert_eq(zinf_saved_at(dir, &ns), -ENOENT);
    cr_assert_eq(zinf_saved_tensors(dir, &count), -ENOENT);
    cr_assert_eq(zinf_saved_steps(none, steps), -ENOENT, "no such directory");
    cr_assert_eq(zinf_saved_at(none, &ns), -ENOENT);
    cr_assert_eq(zinf_saved_tensors(none, &count), -ENOENT);
    cr_assert_eq(zinf_saved_steps(NULL, steps), -EINVAL);
    cr_assert_eq(zinf_saved_steps(dir, NULL), -EINVAL);
    cr_assert_eq(zinf_saved_at(NULL, &ns), -EINVAL);
    cr_assert_eq(zinf_saved_at(dir, NULL), -EINVAL);
    cr_assert_eq(zinf_saved_tensors(NULL, &count), -EINVAL);
    cr_assert_eq(zinf_saved_tensors(dir, NULL), -EINVAL);
    free(none);

    struct zinf_options o = {.nvme_path = dir, .device_bytes = 8 * MiB, .host_bytes = 4 * MiB,
                             .block_size = BLOCK, .queue_depth = QD,
                             .device_kind = ZINF_DEVICE_EMULATED, .flags = ZINF_OPEN_NO_PIN};
    zinf_engine *e;
    cr_assert_eq(zinf_open(&o, &e), 0);
    zinf_tensor t[3] = {test_register(e, "nv", n, ZINF_TIER_NVME),
                        test_register(e, "ho", n, ZINF_TIER_HOST),
                        test_register(e, "de", n, ZINF_TIER_DEVICE)};
    cr_assert_eq(zinf_flush_step(NULL, 1, 0), -EINVAL);
    cr_assert_eq(zinf_flush_step(e, -2, 0), -EINVAL, "a step below -1");
    cr_assert_eq(zinf_flush_step(e, 1, 1u << 5), -EINVAL, "unknown flag");
    cr_assert_eq(zinf_drop_previous(NULL), -EINVAL);
    cr_assert_eq(zinf_drop_previous(e), 0, "none to drop");
    int64_t before = (int64_t)time(NULL) * 1000000000 - 2000000000;
    fill_all(e, t, n, 1);
    cr_assert_eq(zinf_flush_step(e, 1, ZINF_FLUSH_KEEP_PREVIOUS), 0);
    fill_all(e, t, n, 2);
    cr_assert_eq(zinf_flush_step(e, 2, ZINF_FLUSH_KEEP_PREVIOUS), 0);
    cr_assert_eq(zinf_saved_steps(dir, steps), 0);
    cr_expect(steps[0] == 2 && steps[1] == 1, "steps %lld, %lld", (long long)steps[0],
              (long long)steps[1]);
    cr_assert_eq(zinf_saved_tensors(dir, &count), 0);
    cr_expect_eq(count, 3);
    cr_assert_eq(zinf_saved_at(dir, &ns), 0);
    cr_expect(ns >= before && ns <= (int64_t)time(NULL) * 1000000000 + 2000000000,
              "saved at %lld ns", (long long)ns);
    fill_all(e, t, n, 3);
    zinf_close_unflushed(e); /* as a crash would leave it: step 3 never saved */
    zinf_close_unflushed(NULL);

    /* The kept version, read-only: nothing that writes is allowed. */
    o.flags = ZINF_OPEN_READONLY | ZINF_OPEN_PREVIOUS | ZINF_OPEN_NO_PIN;
    cr_assert_eq(zinf_open(&o, &e), 0);
    expect_all(e, n, 1, "the previous version, read-only");
    struct zinf_tensor_info ti;
    cr_assert_eq(zinf_tensor_info(e, look(e, "nv"), &ti), 0);
    cr_expect(ti.home == ZINF_TIER_NVME && ti.bytes == n);
    cr_assert_eq(zinf_flush_step(e, 4, 0), -EROFS);
    cr_assert_eq(zinf_drop_previous(e), -EROFS);
    zinf_close(e);
    o.flags = ZINF_OPEN_PREVIOUS;
    cr_assert_eq(zinf_open(&o, &e), -EINVAL, "PREVIOUS without RESUME or READONLY");
    o.flags = ZINF_OPEN_PREVIOUS | ZINF_OPEN_OVERWRITE;
    cr_assert_eq(zinf_open(&o, &e), -EINVAL);

    /* Resumed at the current version, the previous one is dropped on request. */
    o.flags = ZINF_OPEN_RESUME | ZINF_OPEN_NO_PIN;
    cr_assert_eq(zinf_open(&o, &e), 0);
    expect_all(e, n, 2, "the last saved step");
    cr_assert_eq(zinf_flush_step(e, 5, ZINF_FLUSH_KEEP_PREVIOUS), 0);
    expect_tags(5, 2, "kept again");
    cr_assert_eq(zinf_drop_previous(e), 0);
    expect_tags(5, -1, "dropped");
    cr_assert_eq(zinf_drop_previous(e), 0, "none left to drop");
    zinf_close(e);
}

/* A rank that resumes a saved step and closes without changing anything keeps that step,
 * even where a tensor of a memory home was never written (saved as zeros, with no extent):
 * it resumes as saved, so the close's flush saves the same state and keeps the tag. A resume
 * that changes something and saves it carries the step it was given. */
static void register_mixed(zinf_engine *e, size_t n, zinf_tensor *t)
{
    t[0] = test_register(e, "nv", n, ZINF_TIER_NVME);
    t[1] = test_register(e, "nv2", n, ZINF_TIER_NVME);
    t[2] = test_register(e, "ho", n, ZINF_TIER_HOST);
    t[3] = test_register(e, "de", n, ZINF_TIER_DEVICE);
}

static void expect_mixed(zinf_engine *e, size_t n, const unsigned char *a, const unsigned char *b,
                         const char *what)
{
    unsigned char *z = calloc(1, n);
    expect_everywhere(e, look(e, "nv"), a, n, what);
    expect_everywhere(e, look(e, "nv2"), b, n, what);
    expect_everywhere(e, look(e, "ho"), z, n, what);
    expect_everywhere(e, look(e, "de"), z, n, what);
    free(z);
}

Test(persist, a_resume_closed_unchanged_keeps_its_step_with_unwritten_memory_homes)
{
    const size_t n = 64 * KiB;
    unsigned char *a = test_rand_buf(n, 11), *b = test_rand_buf(n, 12), *c = test_rand_buf(n, 13);
    int64_t steps[2];
    zinf_tensor t[4];
    zinf_engine *e = open_eng(0, false);
    register_mixed(e, n, t);
    cr_assert_eq(zinf_write(e, t[0], 0, a, n), 0);
    cr_assert_eq(zinf_write(e, t[1], 0, b, n), 0);
    cr_assert_eq(zinf_flush_step(e, 7, 0), 0);
    zinf_close(e);
    cr_assert_eq(zinf_saved_steps(dir, steps), 0);
    cr_assert_eq(steps[0], 7, "saved: step %lld", (long long)steps[0]);

    /* Resumed and closed untouched, twice: the step stays. */
    for (int round = 0; round < 2; round++) {
        e = open_eng(ZINF_OPEN_RESUME, false);
        zinf_close(e);
        cr_assert_eq(zinf_saved_steps(dir, steps), 0);
        cr_assert_eq(steps[0], 7, "resumed and closed (%d): step %lld, want 7", round,
                     (long long)steps[0]);
    }
    e = open_eng(ZINF_OPEN_RESUME, false);
    expect_mixed(e, n, a, b, "resumed after closes");
    cr_assert_eq(zinf_flush(e), 0, "an untagged flush of the same state");
    cr_assert_eq(zinf_saved_steps(dir, steps), 0);
    cr_assert_eq(steps[0], 7, "flushed unchanged: step %lld", (long long)steps[0]);

    /* Changed and saved as step 8: the close after it keeps 8. */
    cr_assert_eq(zinf_write(e, look(e, "nv2"), 0, c, n), 0);
    cr_assert_eq(zinf_flush_step(e, 8, 0), 0);
    zinf_close(e);
    cr_assert_eq(zinf_saved_steps(dir, steps), 0);
    cr_assert_eq(steps[0], 8, "changed and saved: step %lld, want 8", (long long)steps[0]);
    e = open_eng(ZINF_OPEN_RESUME, false);
    expect_mixed(e, n, a, c, "resumed at step 8");
    /* Changed and closed without a tag: not step 8 any more. */
    cr_assert_eq(zinf_write(e, look(e, "nv"), 0, b, n), 0);
    zinf_close(e);
    cr_assert_eq(zinf_saved_steps(dir, steps), 0);
    cr_assert_eq(steps[0], -1, "changed by a plain close: step %lld", (long long)steps[0]);
    free(a);
    free(b);
    free(c);
}

/* zinf_saved_remove: the saved state goes, both versions and every directory's swap file,
 * as ZINF_OPEN_OVERWRITE would remove it; nothing else in the directories; nothing while an
 * engine holds the files. */
Test(persist, saved_remove_removes_the_saved_state_and_nothing_else)
{
    zinf_engine *e = open_eng(ZINF_OPEN_NO_PIN, true);
    zinf_tensor t = test_register(e, "nv", 64 * KiB, ZINF_TIER_NVME);
    unsigned char *ref = test_rand_buf(64 * KiB, 7);
    cr_assert_eq(zinf_write(e, t, 0, ref, 64 * KiB), 0);
    cr_assert_eq(zinf_flush_step(e, 1, ZINF_FLUSH_KEEP_PREVIOUS), 0);
    cr_assert_eq(zinf_flush_step(e, 2, ZINF_FLUSH_KEEP_PREVIOUS), 0);
    const char *extra[] = {dir2, NULL};
    cr_assert_eq(zinf_saved_remove(dir, extra), -EBUSY, "an engine holds the swap files");
    size_t count;
    cr_assert_eq(zinf_saved_tensors(dir, &count), 0, "nothing removed");
    zinf_close(e);

    char *others[2] = {path_in(dir, "notes.txt"), path_in(dir2, "notes.txt")};
    for (int i = 0; i < 2; i++)
        spill(others[i], "x", 1);
    cr_assert_eq(zinf_saved_remove(dir, extra), 0);
    cr_assert_eq(zinf_saved_tensors(dir, &count), -ENOENT);
    static const char *const gone[] = {MANIFEST, MANIFEST ".prev", "zinf-swap.0"};
    for (size_t i = 0; i < sizeof(gone) / sizeof(gone[0]); i++) {
        char *p = path_in(dir, gone[i]);
        cr_assert_neq(access(p, F_OK), 0, "%s is left", p);
        free(p);
    }
    char *p = path_in(dir2, "zinf-swap.1");
    cr_assert_neq(access(p, F_OK), 0, "%s is left", p);
    free(p);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(access(others[i], F_OK), 0, "%s was removed", others[i]);
        free(others[i]);
    }
    e = open_eng(0, true); /* nothing saved to refuse over */
    zinf_close(e);
    cr_assert_eq(zinf_saved_remove(dir, NULL), 0, "nothing saved");
    char *none = path_in(dir, "none");
    cr_assert_eq(zinf_saved_remove(none, NULL), 0, "no such directory");
    free(none);

    cr_assert_eq(zinf_saved_remove(NULL, NULL), -EINVAL);
    const char *many[18];
    for (int i = 0; i < 17; i++)
        many[i] = dir2;
    many[17] = NULL;
    cr_assert_eq(zinf_saved_remove(dir, many), -EINVAL, "18 directories");
    free(ref);
}

/* A crash between the two renames of a keeping flush leaves the previous manifest alone:
 * it counts as the current one (probe, versions, resume). */
Test(persist, a_previous_version_alone_is_the_current_one)
{
    const size_t n = 100 * KiB;
    zinf_tensor t[3];
    zinf_engine *e = three_saved(n, 7, 5, t);
    api_close_unflushed(e);
    char *cur = path_in(dir, MANIFEST), *prev = path_in(dir, MANIFEST ".prev");
    cr_assert_eq(rename(cur, prev), 0);
    expect_tags(5, -1, "only .prev");
    size_t count;
    cr_assert_eq(persist_probe(dir, &count, NULL), 0);
    cr_assert_eq(count, 3);
    cr_assert_eq(open_prev(ZINF_OPEN_RESUME, &e), 0);
    expect_all(e, n, 7, ".prev resumed");
    cr_assert_eq(access(cur, F_OK), 0, "it took the current one's place");
    cr_assert_neq(access(prev, F_OK), 0);
    zinf_close(e);
    free(cur);
    free(prev);
}

/* Kept versions are freed: many rounds of keep-and-drop (and of keep-without-drop) use no
 * more swap than two versions of every tensor. */
Test(persist, kept_versions_do_not_grow_the_swap_space)
{
    enum { N = 4 };
    const size_t n = 128 * KiB;
    zinf_engine *e;
    cr_assert_eq(open_prev(0, &e), 0);
    zinf_tensor t[N];
    for (int i = 0; i < N; i++) {
        char name[16];
        snprintf(name, sizeof(name), "t%d", i);
        t[i] = test_register(e, name, n, i % 2 ? ZINF_TIER_NVME : ZINF_TIER_HOST);
    }
    unsigned char *b = malloc(n);
    struct zinf_stats st;
    for (int round = 0; round < 12; round++) {
        memset(b, round, n);
        for (int i = 0; i < N; i++)
            cr_assert_eq(zinf_write(e, t[i], 0, b, n), 0);
        cr_assert_eq(engine_flush_tagged(e, round, true), 0);
        if (round % 3 == 0) cr_assert_eq(engine_drop_previous(e), 0);
        cr_assert_eq(zinf_stats(e, &st), 0);
        cr_assert_leq(st.tier[ZINF_TIER_NVME].used_bytes, (uint64_t)3 * N * n,
                      "round %d: %llu bytes of swap", round,
                      (unsigned long long)st.tier[ZINF_TIER_NVME].used_bytes);
    }
    cr_assert_eq(zinf_flush(e), 0); /* a plain flush keeps no previous version */
    expect_tags(11, -1, "plain flush of the same state");
    for (int i = 0; i < N; i++)
        cr_assert_eq(zinf_unregister(e, t[i]), 0);
    cr_assert_eq(zinf_flush(e), 0);
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tier[ZINF_TIER_NVME].used_bytes, 0, "all free");
    zinf_close(e);
    free(b);
}

/* A growth cut short by a crash: ext4's fallocate may extend a file before it fails for
 * want of space, and a kill before the cut back leaves an odd size. Resume takes the files
 * down to whole stripes and brings every tensor back. */
Test(persist, a_growth_cut_short_by_a_crash_still_resumes)
{
    unsigned char *ref[ARRAY_SIZE(specs)];
    zinf_engine *e = open_eng(0, true);
    zinf_tensor pinned = 0;
    for (size_t i = 0; i < ARRAY_SIZE(specs); i++) {
        test_register(e, specs[i].name, specs[i].n, specs[i].home);
        ref[i] = malloc(specs[i].n);
    }
    fill_specs(e, ref, 7, &pinned);
    cr_assert_eq(zinf_release(e, pinned, ZINF_TIER_DEVICE, 0), 0);
    zinf_close(e);
    char *f0 = path_in(dir, "zinf-swap.0"), *f1 = path_in(dir2, "zinf-swap.1");
    struct stat st;
    cr_assert_eq(stat(f0, &st), 0);
    off_t size = st.st_size;
    cr_assert_eq(truncate(f0, size + 12345), 0);
    cr_assert_eq(truncate(f1, size + 3 * 4096), 0);
    e = open_eng(ZINF_OPEN_RESUME, true);
    for (size_t i = 0; i < ARRAY_SIZE(specs); i++)
        expect_everywhere(e, look(e, specs[i].name), ref[i], specs[i].n, specs[i].name);
    zinf_close(e);
    cr_assert_eq(stat(f0, &st), 0);
    cr_assert_eq(st.st_size, size, "cut back to whole stripes");
    cr_assert_eq(stat(f1, &st), 0);
    cr_assert_eq(st.st_size, size);
    free(f0);
    free(f1);
    for (size_t i = 0; i < ARRAY_SIZE(specs); i++)
        free(ref[i]);
}

/* A read-only reader next to a writer that flushes, frees extents and reuses them: each of
 * its reads of a tensor gives that tensor's bytes as it read the state (the old ones) or
 * -ESTALE, never another tensor's. */
Test(persist, a_readonly_reader_never_reads_another_tensors_bytes)
{
    const size_t n = 64 * 1024;
    enum { N = 4 };
    zinf_engine *w = open_eng(0, false);
    zinf_tensor t[N];
    unsigned char *first[N];
    for (int i = 0; i < N; i++) {
        char name[8];
        snprintf(name, sizeof(name), "t%d", i);
        t[i] = test_register(w, name, n, ZINF_TIER_NVME);
        first[i] = test_rand_buf(n, 500 + (uint64_t)i);
        cr_assert_eq(zinf_write(w, t[i], 0, first[i], n), 0);
    }
    cr_assert_eq(zinf_flush(w), 0);
    zinf_engine *r = open_eng(ZINF_OPEN_READONLY, false);
    zinf_tensor rt[N];
    for (int i = 0; i < N; i++) {
        char name[8];
        snprintf(name, sizeof(name), "t%d", i);
        rt[i] = look(r, name);
    }
    /* The writer moves every tensor to new extents, flushes (the old ones are free), and
     * again (the new copies take the old extents). */
    unsigned char *buf = malloc(n);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < N; i++) {
            memset(buf, 0x40 + round * N + i, n);
            cr_assert_eq(zinf_write(w, t[i], 0, buf, n), 0);
        }
        cr_assert_eq(zinf_flush(w), 0);
    }
    unsigned stale = 0;
    for (int i = 0; i < N; i++) {
        memset(buf, 0, n);
        int res = zinf_read(r, rt[i], 0, buf, n);
        cr_assert(res == 0 || res == -ESTALE, "read of t%d: %s", i, zinf_strerror(res));
        if (res == 0)
            cr_assert_eq(memcmp(buf, first[i], n), 0, "t%d read another tensor's bytes", i);
        stale += res == -ESTALE;
        res = zinf_read(r, rt[i], n / 2, buf, 100); /* a part alone is checked too */
        cr_assert(res == 0 || res == -ESTALE, "part of t%d: %s", i, zinf_strerror(res));
        if (res == 0) cr_assert_eq(memcmp(buf, first[i] + n / 2, 100), 0);
        void *p;
        res = zinf_fetch(r, rt[i], ZINF_TIER_HOST, &p);
        cr_assert(res == 0 || res == -ESTALE, "fetch of t%d: %s", i, zinf_strerror(res));
        if (res == 0) {
            cr_assert_eq(memcmp(p, first[i], n), 0, "t%d fetched another tensor's bytes", i);
            cr_assert_eq(zinf_release(r, rt[i], ZINF_TIER_HOST, 0), 0);
        }
    }
    cr_assert_gt(stale, 0, "the writer reused no extent: the test shows nothing");
    zinf_close(r);
    /* Reopened, the reader sees the writer's newest state. */
    r = open_eng(ZINF_OPEN_READONLY, false);
    memset(buf, 0x40 + 2 * N + 1, n);
    test_expect_content(r, look(r, "t1"), buf, n, "the newest state");
    zinf_close(r);
    zinf_close(w);
    free(buf);
    for (int i = 0; i < N; i++)
        free(first[i]);
}
