/*
 * test_nvme.c - the NVMe swap space (src/tiers/nvme.c) over a real IO engine: read after
 * write through many extents, striping over two directories checked against the files'
 * bytes, fixed and capped capacities, growth and its all-or-nothing failure, reopening
 * kept files and reserving their extents, tmpfs, the buffered fallback, bad input, and
 * every failure path of nvme_open(). The io_uring and thread-pool backends run the data
 * tests.
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
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "helpers.h"
#include "io/uring.h"
#include "tiers/nvme.h"

#define BLOCK (64 * KiB)
#define PAGE (4 * KiB)

static char *dir, *dir2;

static void setup(void)
{
    dir = test_tmpdir("nvme");
    dir2 = test_tmpdir("nvme2");
    cr_assert(dir && dir2);
}

static void teardown(void)
{
    test_leak_check();
    test_log_capture_stop();
    test_rmtree(dir);
    test_rmtree(dir2);
    dir = dir2 = NULL;
}

TestSuite(nvme, .init = setup, .fini = teardown, .timeout = 180);

static struct uring *open_engine(enum uring_backend b)
{
    struct uring *u = NULL;
    struct uring_opts o = {.block_size = BLOCK, .queue_depth = 8, .backend = b};
    int r = uring_open(&o, &u);
    cr_assert_eq(r, 0, "uring_open: %s", strerror(-r));
    return u;
}

static struct nvme *open_swap(struct uring *u, const char *const *dirs, unsigned ndirs,
                              uint64_t capacity, uint64_t max)
{
    struct nvme *n = NULL;
    struct nvme_opts o = {.dirs = dirs,
                          .ndirs = ndirs,
                          .capacity_bytes = capacity,
                          .max_bytes = max,
                          .remove_on_close = true};
    int r = nvme_open(&o, u, &n);
    cr_assert_eq(r, 0, "nvme_open: %s", strerror(-r));
    return n;
}

static char *swap_path(const char *d, unsigned i)
{
    char *p;
    cr_assert_geq(asprintf(&p, "%s/%s.%u", d, NVME_SWAP_NAME, i), 0);
    return p;
}

static int64_t file_size(const char *d, unsigned i)
{
    struct stat st;
    char *p = swap_path(d, i);
    int r = stat(p, &st);
    free(p);
    return r == 0 ? (int64_t)st.st_size : -1;
}

/* How many lines of the captured log contain needle. */
static unsigned log_lines_with(const char *needle)
{
    unsigned count = 0;
    const char *t = test_log_text();
    while (*t) {
        const char *eol = strchr(t, '\n');
        size_t len = eol ? (size_t)(eol - t) : strlen(t);
        char *line = strndup(t, len);
        count += strstr(line, needle) != NULL;
        free(line);
        t += len + (eol != NULL);
    }
    return count;
}

/* One extent and what was written into it. */
struct ext {
    uint64_t off, len, seed;
};

static void write_ext(struct nvme *n, const struct ext *e)
{
    void *buf = test_aligned_alloc(e->len);
    test_fill_random(buf, e->len, e->seed);
    int r = nvme_write(n, e->off, buf, e->len);
    cr_assert_eq(r, 0, "write %llu+%llu: %s", (unsigned long long)e->off,
                 (unsigned long long)e->len, strerror(-r));
    free(buf);
}

static void expect_ext(struct nvme *n, const struct ext *e)
{
    void *buf = test_aligned_alloc(e->len), *want = test_aligned_alloc(e->len);
    test_fill_random(want, e->len, e->seed);
    memset(buf, 0xa5, e->len);
    int r = nvme_read(n, e->off, buf, e->len);
    cr_assert_eq(r, 0, "read %llu+%llu: %s", (unsigned long long)e->off, (unsigned long long)e->len,
                 strerror(-r));
    cr_assert_eq(memcmp(buf, want, e->len), 0, "extent at %llu (%llu bytes) came back wrong",
                 (unsigned long long)e->off, (unsigned long long)e->len);
    free(buf);
    free(want);
}

/* A size in 4 KiB units that is never a whole number of blocks. */
static uint64_t odd_size(uint64_t *s, unsigned max_pages)
{
    uint64_t pages;
    do
        pages = 1 + test_rand(s) % max_pages;
    while (pages % (BLOCK / PAGE) == 0);
    return pages * PAGE;
}

/* ---- open, close, bad options ------------------------------------------------------ */

Test(nvme, open_close_one_dir)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct nvme *n = NULL;
    struct nvme_stats st;
    struct nvme_opts o = {.dirs = dirs, .ndirs = 1, .capacity_bytes = MiB + 4 * KiB};

    cr_assert_eq(nvme_open(&o, u, &n), 0);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.files, 1);
    cr_expect_eq(st.block_size, BLOCK);       /* the engine's block size by default */
    cr_expect_eq(st.file_bytes, MiB + BLOCK); /* rounded up to whole stripes */
    cr_expect_eq(st.capacity_bytes, MiB + BLOCK);
    cr_expect_eq(st.free_bytes, MiB + BLOCK);
    cr_expect_eq(st.used_bytes, 0);
    cr_expect_not(st.growable);
    char *p = swap_path(dir, 0);
    cr_expect_str_eq(st.paths[0], p);
    cr_expect_eq(file_size(dir, 0), (int64_t)(MiB + BLOCK));
    cr_expect_eq(nvme_sync(n), 0);
    nvme_close(n);
    /* Without remove_on_close the file stays. */
    cr_expect_eq(file_size(dir, 0), (int64_t)(MiB + BLOCK));

    /* An existing file is truncated and reused. */
    o.capacity_bytes = BLOCK;
    o.remove_on_close = true;
    cr_assert_eq(nvme_open(&o, u, &n), 0);
    cr_expect_eq(file_size(dir, 0), (int64_t)BLOCK);
    nvme_close(n);
    cr_expect_eq(access(p, F_OK), -1, "remove_on_close left %s behind", p);
    free(p);
    nvme_close(NULL);
    uring_close(u);
}

Test(nvme, open_bad_options)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[NVME_MAX_DIRS + 1];
    const char *with_null[] = {dir, NULL};
    const char *with_empty[] = {""};
    struct nvme *n = NULL;

    for (unsigned i = 0; i <= NVME_MAX_DIRS; i++)
        dirs[i] = dir;
    struct nvme_opts o = {.dirs = dirs, .ndirs = 1, .capacity_bytes = MiB};
    cr_expect_eq(nvme_open(NULL, u, &n), -EINVAL);
    cr_expect_eq(nvme_open(&o, NULL, &n), -EINVAL);
    cr_expect_eq(nvme_open(&o, u, NULL), -EINVAL);
    o.ndirs = 0;
    cr_expect_eq(nvme_open(&o, u, &n), -EINVAL);
    o.ndirs = NVME_MAX_DIRS + 1;
    cr_expect_eq(nvme_open(&o, u, &n), -EINVAL);
    o = (struct nvme_opts){.dirs = with_null, .ndirs = 2};
    cr_expect_eq(nvme_open(&o, u, &n), -EINVAL);
    o = (struct nvme_opts){.dirs = with_empty, .ndirs = 1};
    cr_expect_eq(nvme_open(&o, u, &n), -EINVAL);
    o = (struct nvme_opts){.dirs = dirs, .ndirs = 1, .block_size = 6 * KiB};
    cr_expect_eq(nvme_open(&o, u, &n), -EINVAL);
    o = (struct nvme_opts){.dirs = dirs, .ndirs = 1, .capacity_bytes = UINT64_MAX};
    cr_expect_eq(nvme_open(&o, u, &n), -EINVAL);
    cr_expect_null(n);
    /* The most directories allowed, all in one place: names differ by index. */
    o = (struct nvme_opts){
        .dirs = dirs, .ndirs = NVME_MAX_DIRS, .capacity_bytes = MiB, .remove_on_close = true};
    cr_assert_eq(nvme_open(&o, u, &n), 0);
    cr_expect_eq(file_size(dir, NVME_MAX_DIRS - 1), (int64_t)BLOCK);
    nvme_close(n);
    uring_close(u);
}

Test(nvme, missing_directory_is_enoent)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    char *missing;
    struct nvme *n = NULL;

    cr_assert_geq(asprintf(&missing, "%s/does/not/exist", dir), 0);
    const char *dirs[] = {missing};
    struct nvme_opts o = {.dirs = dirs, .ndirs = 1, .capacity_bytes = MiB};
    test_log_capture_start();
    cr_expect_eq(nvme_open(&o, u, &n), -ENOENT);
    cr_expect_null(n);
    cr_expect_eq(log_lines_with(missing), 1, "log: %s", test_log_text());

    /* The second of two directories is missing: the first one's file is removed again. */
    const char *two[] = {dir, missing};
    o = (struct nvme_opts){.dirs = two, .ndirs = 2, .capacity_bytes = MiB};
    cr_expect_eq(nvme_open(&o, u, &n), -ENOENT);
    cr_expect_eq(file_size(dir, 0), -1, "a failed open left a swap file behind");
    free(missing);
    uring_close(u);
}

Test(nvme, uncreatable_file_fails_cleanly)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = NULL;
    struct nvme_opts o = {.dirs = dirs, .ndirs = 2, .capacity_bytes = MiB};

    /* A directory squats on the second swap file's name. */
    char *p = swap_path(dir2, 1);
    cr_assert_eq(mkdir(p, 0755), 0);
    test_log_capture_start();
    cr_expect_eq(nvme_open(&o, u, &n), -EISDIR);
    cr_expect_null(n);
    cr_expect_eq(log_lines_with(p), 1, "log: %s", test_log_text());
    cr_expect_eq(file_size(dir, 0), -1);
    rmdir(p);
    free(p);
    cr_assert_eq(nvme_open(&o, u, &n), 0);
    nvme_close(n);
    uring_close(u);
}

Test(nvme, second_swap_space_on_same_files_is_ebusy)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct nvme *a = NULL, *b = NULL;
    struct nvme_opts o = {.dirs = dirs, .ndirs = 1, .capacity_bytes = MiB, .remove_on_close = true};
    struct ext e = {.len = 64 * KiB, .seed = 3};

    cr_assert_eq(nvme_open(&o, u, &a), 0);
    cr_assert_eq(nvme_alloc(a, e.len, &e.off), 0);
    write_ext(a, &e);
    test_log_capture_start();
    cr_expect_eq(nvme_open(&o, u, &b), -EBUSY);
    cr_expect_null(b);
    /* The loser neither truncated nor removed the winner's file. */
    cr_expect_eq(file_size(dir, 0), (int64_t)MiB);
    expect_ext(a, &e);
    nvme_close(a);
    uring_close(u);
}

/* ---- data ---------------------------------------------------------------------------- */

static void many_extents(enum uring_backend b, unsigned ndirs)
{
    struct uring *u = open_engine(b);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = open_swap(u, dirs, ndirs, 16 * MiB, 0);
    enum { MAX = 256 };
    struct ext ex[MAX];
    unsigned cnt = 0;
    uint64_t s = 42 + b;

    /* Fill three quarters of the space with odd-sized extents. */
    struct nvme_stats st;
    do {
        struct ext e = {.len = odd_size(&s, 40), .seed = test_rand(&s)};
        cr_assert_eq(nvme_alloc(n, e.len, &e.off), 0);
        write_ext(n, &e);
        ex[cnt++] = e;
        nvme_get_stats(n, &st);
    } while (cnt < MAX && st.used_bytes < 12 * MiB);
    cr_assert_gt(cnt, 50);
    for (unsigned i = 0; i < cnt; i++)
        expect_ext(n, &ex[i]);

    /* Free a third, reuse the holes, and check that nothing else was clobbered. */
    for (unsigned i = 0; i < cnt; i += 3)
        cr_assert_eq(nvme_free(n, ex[i].off), 0);
    for (unsigned i = 0; i < cnt; i += 3) {
        ex[i].len = MIN(ex[i].len, odd_size(&s, 20)); /* what was freed, and more, fits */
        ex[i].seed = test_rand(&s);
        cr_assert_eq(nvme_alloc(n, ex[i].len, &ex[i].off), 0);
        write_ext(n, &ex[i]);
    }
    for (unsigned i = 0; i < cnt; i++)
        expect_ext(n, &ex[i]);
    for (unsigned i = 0; i < cnt; i++)
        cr_assert_eq(nvme_free(n, ex[i].off), 0);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.used_bytes, 0);
    cr_expect_eq(st.free_extents, 1);
    nvme_close(n);
    uring_close(u);
}

Test(nvme, many_extents_io_uring)
{
    many_extents(URING_BACKEND_IO_URING, 1);
}
Test(nvme, many_extents_threads)
{
    many_extents(URING_BACKEND_THREADS, 1);
}
Test(nvme, many_extents_striped_io_uring)
{
    many_extents(URING_BACKEND_IO_URING, 2);
}
Test(nvme, many_extents_striped_threads)
{
    many_extents(URING_BACKEND_THREADS, 2);
}

/* Striping: the same bytes come back, and each file holds exactly the stripes the layout
 * gives it, checked by reading the files directly. */
static void striped_layout(enum uring_backend b)
{
    struct uring *u = open_engine(b);
    const char *dirs[] = {dir, dir2};
    const uint64_t cap = 4 * MiB;
    struct nvme *n = open_swap(u, dirs, 2, cap, 0);
    unsigned char *image = calloc(1, cap), *files[2];
    struct ext ex[16];
    unsigned cnt = 0;
    uint64_t s = 9;

    /* The first extent spans several stripes and ends mid-stripe; the rest are odd
     * sizes, so they start and end anywhere in a stripe. */
    while (cnt < ARRAY_SIZE(ex)) {
        struct ext e = {.len = cnt == 0 ? 3 * BLOCK + 8 * KiB : odd_size(&s, 50),
                        .seed = test_rand(&s)};
        if (nvme_alloc(n, e.len, &e.off) != 0) break;
        write_ext(n, &e);
        test_fill_random(image + e.off, e.len, e.seed);
        ex[cnt++] = e;
    }
    cr_assert_gt(cnt, 8);
    for (unsigned i = 0; i < cnt; i++)
        expect_ext(n, &ex[i]);
    cr_assert_eq(nvme_sync(n), 0);

    /* Both files have half the capacity and both hold data. */
    for (unsigned f = 0; f < 2; f++) {
        const char *d = dirs[f];
        cr_expect_eq(file_size(d, f), (int64_t)(cap / 2));
        char *p = swap_path(d, f);
        int fd = open(p, O_RDONLY);
        cr_assert_geq(fd, 0);
        files[f] = malloc(cap / 2);
        cr_assert_eq(pread(fd, files[f], cap / 2, 0), (ssize_t)(cap / 2));
        close(fd);
        free(p);
    }
    for (unsigned i = 0; i < cnt; i++) {
        for (uint64_t l = ex[i].off; l < ex[i].off + ex[i].len; l += PAGE) {
            uint64_t stripe = l / BLOCK;
            unsigned f = stripe % 2;
            uint64_t phys = (stripe / 2) * BLOCK + l % BLOCK;
            cr_assert_eq(memcmp(files[f] + phys, image + l, PAGE), 0,
                         "logical %llu is not at file %u offset %llu", (unsigned long long)l, f,
                         (unsigned long long)phys);
        }
    }
    /* The first extent alone covers stripes 0..3: file 0 holds 0 and 2, file 1 holds 1
     * and 3, so each file's first 64 KiB came from the first extent's data. */
    cr_expect_eq(memcmp(files[0], image, BLOCK), 0);
    cr_expect_eq(memcmp(files[1], image + BLOCK, BLOCK), 0);
    free(files[0]);
    free(files[1]);
    free(image);
    nvme_close(n);
    uring_close(u);
}

Test(nvme, striped_layout_io_uring)
{
    striped_layout(URING_BACKEND_IO_URING);
}
Test(nvme, striped_layout_threads)
{
    striped_layout(URING_BACKEND_THREADS);
}

struct waiter {
    pthread_mutex_t lock;
    pthread_cond_t cv;
    unsigned done;
    int first_err;
};

static void count_cb(struct uring_req *req, int res)
{
    struct waiter *w = req->data;
    pthread_mutex_lock(&w->lock);
    if (res < 0 && !w->first_err) w->first_err = res;
    w->done++;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->lock);
}

static void wait_for(struct waiter *w, unsigned n)
{
    pthread_mutex_lock(&w->lock);
    while (w->done < n)
        pthread_cond_wait(&w->cv, &w->lock);
    pthread_mutex_unlock(&w->lock);
}

/* Many asynchronous requests in flight at once (more than the queue depth), striped. */
static void async_submit(enum uring_backend b)
{
    struct uring *u = open_engine(b);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = open_swap(u, dirs, 2, 0, 0);
    enum { N = 24 };
    struct uring_req req[N];
    struct ext ex[N];
    void *buf[N];
    struct waiter w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
    uint64_t s = 5;

    for (unsigned i = 0; i < N; i++) {
        ex[i] = (struct ext){.len = odd_size(&s, 60), .seed = test_rand(&s)};
        cr_assert_eq(nvme_alloc(n, ex[i].len, &ex[i].off), 0);
        buf[i] = test_aligned_alloc(ex[i].len);
        test_fill_random(buf[i], ex[i].len, ex[i].seed);
        req[i] = (struct uring_req){.op = URING_WRITE,
                                    .buf = buf[i],
                                    .len = ex[i].len,
                                    .off = ex[i].off,
                                    .cb = count_cb,
                                    .data = &w};
        cr_assert_eq(nvme_submit(n, &req[i]), 0);
    }
    wait_for(&w, N);
    cr_assert_eq(w.first_err, 0, "write: %s", strerror(-w.first_err));
    for (unsigned i = 0; i < N; i++) {
        memset(buf[i], 0, ex[i].len);
        req[i] = (struct uring_req){.op = URING_READ,
                                    .buf = buf[i],
                                    .len = ex[i].len,
                                    .off = ex[i].off,
                                    .cb = count_cb,
                                    .data = &w};
        cr_assert_eq(nvme_submit(n, &req[i]), 0);
    }
    wait_for(&w, 2 * N);
    cr_assert_eq(w.first_err, 0, "read: %s", strerror(-w.first_err));
    for (unsigned i = 0; i < N; i++) {
        void *want = test_aligned_alloc(ex[i].len);
        test_fill_random(want, ex[i].len, ex[i].seed);
        cr_expect_eq(memcmp(buf[i], want, ex[i].len), 0, "request %u", i);
        free(want);
        free(buf[i]);
    }
    nvme_close(n);
    uring_close(u);
}

Test(nvme, async_submit_io_uring)
{
    async_submit(URING_BACKEND_IO_URING);
}
Test(nvme, async_submit_threads)
{
    async_submit(URING_BACKEND_THREADS);
}

Test(nvme, io_bad_arguments)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct nvme *n = open_swap(u, dirs, 1, MiB, 0);
    void *buf = test_aligned_alloc(2 * BLOCK);
    uint64_t off, other;
    struct waiter w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};

    cr_assert_eq(nvme_alloc(n, 2 * PAGE, &off), 0);
    cr_assert_eq(nvme_alloc(n, 2 * PAGE, &other), 0);
    cr_expect_eq(nvme_write(n, off, buf, 2 * PAGE), 0);
    cr_expect_eq(nvme_write(n, off + PAGE, buf, PAGE), 0);              /* inside: fine */
    cr_expect_eq(nvme_write(n, off, (char *)buf + 512, PAGE), -EINVAL); /* unaligned buf */
    cr_expect_eq(nvme_write(n, off, buf, PAGE + 512), -EINVAL);         /* unaligned len */
    cr_expect_eq(nvme_write(n, off + 512, buf, PAGE), -EINVAL);         /* unaligned off */
    cr_expect_eq(nvme_write(n, off, buf, 0), -EINVAL);
    cr_expect_eq(nvme_write(n, off, NULL, PAGE), -EINVAL);
    cr_expect_eq(nvme_read(n, off, buf, 3 * PAGE), -EINVAL);   /* runs into the next one */
    cr_expect_eq(nvme_read(n, 64 * PAGE, buf, PAGE), -EINVAL); /* free space */
    cr_expect_eq(nvme_read(n, 4 * MiB, buf, PAGE), -EINVAL);   /* beyond the capacity */
    cr_expect_eq(nvme_read(n, UINT64_MAX & ~(uint64_t)(PAGE - 1), buf, 2 * PAGE), -EINVAL);
    cr_expect_eq(nvme_read(NULL, off, buf, PAGE), -EINVAL);

    /* A refused request never calls back. */
    struct uring_req req = {
        .op = URING_READ, .buf = buf, .len = PAGE, .off = 64 * PAGE, .cb = count_cb, .data = &w};
    cr_expect_eq(nvme_submit(n, &req), -EINVAL);
    cr_expect_eq(nvme_submit(n, NULL), -EINVAL);
    uring_drain(u);
    cr_expect_eq(w.done, 0);

    /* After a free the range is no longer addressable; a second free is refused. */
    cr_assert_eq(nvme_free(n, off), 0);
    cr_expect_eq(nvme_read(n, off, buf, PAGE), -EINVAL);
    cr_expect_eq(nvme_free(n, off), -EINVAL);
    cr_expect_eq(nvme_free(n, other + PAGE), -EINVAL);
    cr_expect_eq(nvme_free(NULL, other), -EINVAL);
    cr_expect_eq(nvme_alloc(n, 0, &off), -EINVAL);
    cr_expect_eq(nvme_alloc(n, PAGE, NULL), -EINVAL);
    cr_expect_eq(nvme_alloc(NULL, PAGE, &off), -EINVAL);
    cr_expect_eq(nvme_sync(NULL), -EINVAL);
    free(buf);
    nvme_close(n);
    uring_close(u);
}

/* ---- capacity and growth ----------------------------------------------------------- */

Test(nvme, fixed_capacity_enospc_leaves_state_unchanged)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = open_swap(u, dirs, 2, MiB, 0);
    struct nvme_stats before, after;
    struct ext e = {.len = 768 * KiB, .seed = 77}, f = {.len = 256 * KiB, .seed = 78};
    uint64_t off;

    cr_assert_eq(nvme_alloc(n, e.len, &e.off), 0);
    write_ext(n, &e);
    nvme_get_stats(n, &before);
    test_log_capture_start();
    cr_expect_eq(nvme_alloc(n, 512 * KiB, &off), -ENOSPC);
    cr_expect_eq(log_lines_with("no space"), 1, "log: %s", test_log_text());
    cr_expect_eq(log_lines_with(dir), 1, "the error names the directories: %s", test_log_text());
    cr_expect_eq(log_lines_with(dir2), 1);
    cr_expect_eq(log_lines_with("512 KiB"), 1, "the error gives the size: %s", test_log_text());
    nvme_get_stats(n, &after);
    cr_expect_eq(memcmp(&before, &after, sizeof(before)), 0);
    /* A smaller allocation that fits still works, and old data is intact. */
    cr_assert_eq(nvme_alloc(n, f.len, &f.off), 0);
    write_ext(n, &f);
    expect_ext(n, &e);
    expect_ext(n, &f);
    cr_expect_eq(nvme_alloc(n, PAGE, &off), -ENOSPC);
    cr_expect_eq(file_size(dir, 0), (int64_t)(512 * KiB)); /* never grows */
    nvme_close(n);
    uring_close(u);
}

Test(nvme, grows_on_demand)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = open_swap(u, dirs, 2, 0, 0);
    struct nvme_stats st;
    struct ext a = {.len = MiB + PAGE, .seed = 1};
    uint64_t b;

    nvme_get_stats(n, &st);
    cr_expect(st.growable);
    cr_expect_eq(st.capacity_bytes, 0);
    cr_expect_eq(file_size(dir, 0), 0);
    /* The first allocation grows each file by the minimum step. */
    cr_assert_eq(nvme_alloc(n, a.len, &a.off), 0);
    write_ext(n, &a);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.grows, 1);
    cr_expect_eq(st.file_bytes, NVME_GROW_MIN_BYTES);
    cr_expect_eq(st.capacity_bytes, 2 * NVME_GROW_MIN_BYTES);
    cr_expect_eq(file_size(dir, 0), (int64_t)NVME_GROW_MIN_BYTES);
    cr_expect_eq(file_size(dir2, 1), (int64_t)NVME_GROW_MIN_BYTES);
    /* The rest of the space is handed out without growing. */
    cr_assert_eq(nvme_alloc(n, st.free_bytes, &b), 0);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.grows, 1);
    cr_expect_eq(st.free_bytes, 0);
    /* Data at the far end of the grown space (the end of both files) reads back. */
    struct ext end = {.off = st.capacity_bytes - 2 * BLOCK, .len = 2 * BLOCK, .seed = 3};
    write_ext(n, &end);
    expect_ext(n, &end);
    expect_ext(n, &a);
    nvme_close(n);
    uring_close(u);
}

/* An allocation larger than the minimum step grows by what the free tail lacks. */
Test(nvme, growth_step_fits_large_allocations)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct nvme *n = open_swap(u, dirs, 1, 0, 0);
    struct nvme_stats st;
    struct ext a = {.len = MiB, .seed = 5};
    uint64_t b;

    cr_assert_eq(nvme_alloc(n, a.len, &a.off), 0);
    write_ext(n, &a);
    cr_assert_eq(nvme_alloc(n, 600 * MiB, &b), 0);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.grows, 2);
    cr_expect_eq(b, MiB, "the allocation joined the free tail");
    cr_expect_eq(st.file_bytes, MiB + 600 * MiB);
    cr_expect_eq(file_size(dir, 0), (int64_t)(601 * MiB));
    expect_ext(n, &a);
    nvme_close(n);
    uring_close(u);
}

Test(nvme, growth_cap_enospc_leaves_state_unchanged)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct nvme *n = open_swap(u, dirs, 1, 0, 320 * MiB);
    struct nvme_stats before, after;
    struct ext a = {.len = MiB, .seed = 4};
    uint64_t big, off;

    cr_assert_eq(nvme_alloc(n, 200 * MiB + PAGE, &big), 0);
    a.off = big + 100 * MiB; /* a piece of it carries data */
    write_ext(n, &a);
    nvme_get_stats(n, &before);
    cr_expect_eq(before.capacity_bytes, NVME_GROW_MIN_BYTES);
    test_log_capture_start();
    cr_expect_eq(nvme_alloc(n, 200 * MiB, &off), -ENOSPC);
    cr_expect_eq(log_lines_with("no space"), 1, "log: %s", test_log_text());
    cr_expect_eq(log_lines_with(dir), 1);
    cr_expect_eq(log_lines_with("320 MiB"), 1, "the error gives the cap: %s", test_log_text());
    nvme_get_stats(n, &after);
    cr_expect_eq(memcmp(&before, &after, sizeof(before)), 0);
    cr_expect_eq(file_size(dir, 0), (int64_t)NVME_GROW_MIN_BYTES);
    /* Up to the cap still works: growth is clipped to it. */
    cr_assert_eq(nvme_alloc(n, 100 * MiB, &off), 0);
    nvme_get_stats(n, &after);
    cr_expect_eq(after.capacity_bytes, 320 * MiB);
    cr_expect_eq(file_size(dir, 0), (int64_t)(320 * MiB));
    expect_ext(n, &a);
    cr_expect_eq(nvme_alloc(n, 20 * MiB, &off), -ENOSPC);
    nvme_close(n);
    uring_close(u);
}

/* File 0 grows, file 1 cannot: the capacity stays, file 0 is cut back, and the next
 * growth starts from the old size. */
Test(nvme, partial_growth_is_rolled_back)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = open_swap(u, dirs, 2, 0, 0);
    struct nvme_stats before, after;
    struct ext a = {.len = 8 * MiB, .seed = 6};
    uint64_t off;

    cr_assert_eq(nvme_alloc(n, a.len, &a.off), 0);
    write_ext(n, &a);
    nvme_get_stats(n, &before);
    nvme_fault_fallocate(n, 2, ENOSPC);
    test_log_capture_start();
    /* 1100 MiB lacks more than the usual step per file: one try, no smaller retry. */
    cr_expect_eq(nvme_alloc(n, 1100 * MiB, &off), -ENOSPC);
    cr_expect_eq(log_lines_with("no space"), 1, "log: %s", test_log_text());
    cr_expect_eq(log_lines_with(dir2), 1, "the error names the full directory: %s",
                 test_log_text());
    cr_expect_eq(log_lines_with(dir), 0);
    nvme_get_stats(n, &after);
    cr_expect_eq(memcmp(&before, &after, sizeof(before)), 0);
    cr_expect_eq(file_size(dir, 0), (int64_t)NVME_GROW_MIN_BYTES);
    cr_expect_eq(file_size(dir2, 1), (int64_t)NVME_GROW_MIN_BYTES);
    expect_ext(n, &a);
    /* Space that is already there is still handed out, and growth works again. */
    cr_assert_eq(nvme_alloc(n, MiB, &off), 0);
    cr_assert_eq(nvme_alloc(n, 1000 * MiB, &off), 0);
    nvme_get_stats(n, &after);
    cr_expect_eq(after.grows, before.grows + 1);
    cr_expect_eq(file_size(dir, 0), (int64_t)after.file_bytes);
    cr_expect_eq(file_size(dir2, 1), (int64_t)after.file_bytes);
    expect_ext(n, &a);
    nvme_close(n);
    uring_close(u);
}

/* A real refusal from the kernel: RLIMIT_FSIZE makes fallocate() fail with EFBIG, which
 * the swap space reports as -ENOSPC. (Each test runs in its own process.) */
Test(nvme, kernel_refuses_growth)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct rlimit old, lim;
    struct ext a = {.len = MiB, .seed = 8};
    uint64_t off;

    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = 300 * MiB;
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    struct nvme *n = open_swap(u, dirs, 1, 0, 0);
    cr_assert_eq(nvme_alloc(n, a.len, &a.off), 0);
    write_ext(n, &a);
    test_log_capture_start();
    /* 300 MiB lacks 45 MiB beyond the free tail: even that passes the limit. */
    cr_expect_eq(nvme_alloc(n, 300 * MiB, &off), -ENOSPC);
    cr_expect_eq(log_lines_with("no space"), 1, "log: %s", test_log_text());
    cr_expect_eq(log_lines_with(dir), 1);
    cr_expect_eq(log_lines_with("47185920 bytes"), 1, "the bytes it lacked: %s", test_log_text());
    struct nvme_stats st;
    nvme_get_stats(n, &st);
    cr_expect_eq(st.capacity_bytes, NVME_GROW_MIN_BYTES);
    cr_expect_eq(file_size(dir, 0), (int64_t)NVME_GROW_MIN_BYTES);
    expect_ext(n, &a);
    cr_expect_eq(nvme_alloc(n, 128 * MiB, &off), 0);
    nvme_close(n);
    setrlimit(RLIMIT_FSIZE, &old);
    uring_close(u);
}

/* A filesystem with room for what an allocation lacks but not for the usual 256 MiB step
 * (here RLIMIT_FSIZE, as a nearly full drive) still serves it: growth falls back to what
 * is needed. It used to fail with -ENOSPC while the space was there. */
Test(nvme, growth_takes_what_is_needed_when_the_full_step_does_not_fit)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct rlimit old, lim;
    struct ext a = {.len = MiB, .seed = 9}, b = {.len = 256 * MiB};

    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = 300 * MiB;
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    struct nvme *n = open_swap(u, dirs, 1, 0, 0);
    cr_assert_eq(nvme_alloc(n, a.len, &a.off), 0);
    write_ext(n, &a);
    int r = nvme_alloc(n, b.len, &b.off);
    cr_assert_eq(r, 0, "256 MiB more fits under the 300 MiB limit: %s", strerror(-r));
    struct nvme_stats st;
    nvme_get_stats(n, &st);
    cr_expect_eq(st.file_bytes, 257 * MiB, "grown by what was missing: %llu",
                 (unsigned long long)st.file_bytes);
    cr_expect_eq(st.grows, 2);
    cr_expect_eq(file_size(dir, 0), (int64_t)(257 * MiB));
    /* The last MiB of the new extent lies in what the fallback added. */
    struct ext tail = {.off = b.off + b.len - MiB, .len = MiB, .seed = 10};
    write_ext(n, &tail);
    expect_ext(n, &a);
    expect_ext(n, &tail);
    nvme_close(n);
    setrlimit(RLIMIT_FSIZE, &old);
    uring_close(u);
}

/* ---- reopening: keep and reserve ------------------------------------------------------ */

static int open_kept(struct uring *u, const char *const *dirs, unsigned ndirs, uint64_t capacity,
                     struct nvme **n)
{
    struct nvme_opts o = {.dirs = dirs, .ndirs = ndirs, .capacity_bytes = capacity, .keep = true};
    return nvme_open(&o, u, n);
}

/* Whether [a, a + alen) and [b, b + blen) share a byte. */
static bool overlaps(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen)
{
    return a < b + blen && b < a + alen;
}

/* Two extents written, the swap space closed and reopened with keep: once reserved at
 * their offsets they read back byte for byte, and new allocations go around them. */
static void keep_reopens_data(unsigned ndirs)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    const uint64_t cap = 4 * MiB;
    struct nvme *n = NULL;
    struct nvme_stats st, st0;
    struct ext a = {.len = 3 * BLOCK + 8 * KiB, .seed = 21}, c = {.len = 5 * PAGE, .seed = 22};
    uint64_t gap, off;
    void *buf = test_aligned_alloc(PAGE);

    /* [a][gap][c][free]: freeing the gap leaves c away from a, and mid-stripe. */
    struct nvme_opts o = {.dirs = dirs, .ndirs = ndirs, .capacity_bytes = cap};
    cr_assert_eq(nvme_open(&o, u, &n), 0);
    cr_assert_eq(nvme_alloc(n, a.len, &a.off), 0);
    cr_assert_eq(nvme_alloc(n, 7 * PAGE, &gap), 0);
    cr_assert_eq(nvme_alloc(n, c.len, &c.off), 0);
    write_ext(n, &a);
    write_ext(n, &c);
    cr_assert_eq(nvme_free(n, gap), 0);
    cr_assert_eq(nvme_sync(n), 0);
    nvme_get_stats(n, &st0);
    nvme_close(n);
    for (unsigned i = 0; i < ndirs; i++)
        cr_assert_eq(file_size(dirs[i], i), (int64_t)(cap / ndirs));

    n = NULL;
    cr_assert_eq(open_kept(u, dirs, ndirs, cap, &n), 0);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.capacity_bytes, cap);
    cr_expect_eq(st.file_bytes, st0.file_bytes);
    cr_expect_eq(st.used_bytes, 0, "a kept swap space starts with nothing allocated");
    cr_expect_eq(st.free_extents, 1);
    cr_expect_not(st.growable);
    for (unsigned i = 0; i < ndirs; i++)
        cr_expect_eq(file_size(dirs[i], i), (int64_t)(cap / ndirs), "reopening changed a size");
    cr_expect_eq(nvme_read(n, a.off, buf, PAGE), -EINVAL, "readable before it was reserved");

    cr_assert_eq(nvme_reserve(n, c.off, c.len), 0);
    cr_assert_eq(nvme_reserve(n, a.off, a.len), 0);
    expect_ext(n, &a);
    expect_ext(n, &c);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.used_bytes, a.len + c.len);
    cr_expect_eq(st.used_extents, 2);

    /* Reserving any part of them again is refused and changes nothing. */
    cr_expect_eq(nvme_reserve(n, a.off, a.len), -EEXIST);
    cr_expect_eq(nvme_reserve(n, a.off + BLOCK, PAGE), -EEXIST);
    cr_expect_eq(nvme_reserve(n, c.off - PAGE, 2 * PAGE), -EEXIST);
    cr_expect_eq(nvme_reserve(n, a.off, cap), -EEXIST);
    struct nvme_stats again;
    nvme_get_stats(n, &again);
    cr_expect_eq(memcmp(&st, &again, sizeof(st)), 0);

    /* Fill every byte that is left: nothing handed out touches a or c, and both survive
     * the new data written around them. */
    enum { MAX = 256 };
    struct ext fresh[MAX];
    unsigned cnt = 0;
    uint64_t s = 23 + ndirs;
    while (cnt < MAX) {
        struct ext e = {.len = odd_size(&s, 24), .seed = test_rand(&s)};
        int r = nvme_alloc(n, e.len, &e.off);
        if (r == -ENOSPC) {
            nvme_get_stats(n, &st);
            if (st.largest_free_bytes == 0) break;
            e.len = st.largest_free_bytes;
            r = nvme_alloc(n, e.len, &e.off);
        }
        cr_assert_eq(r, 0, "alloc %llu: %s", (unsigned long long)e.len, strerror(-r));
        cr_assert_not(overlaps(e.off, e.len, a.off, a.len), "new extent at %llu overlaps a",
                      (unsigned long long)e.off);
        cr_assert_not(overlaps(e.off, e.len, c.off, c.len), "new extent at %llu overlaps c",
                      (unsigned long long)e.off);
        write_ext(n, &e);
        fresh[cnt++] = e;
    }
    nvme_get_stats(n, &st);
    cr_expect_eq(st.free_bytes, 0, "the space was not filled (%u extents)", cnt);
    cr_expect_eq(nvme_alloc(n, PAGE, &off), -ENOSPC);
    expect_ext(n, &a);
    expect_ext(n, &c);
    for (unsigned i = 0; i < cnt; i++)
        expect_ext(n, &fresh[i]);

    /* A reserved extent frees like an allocated one. */
    cr_assert_eq(nvme_free(n, a.off), 0);
    cr_expect_eq(nvme_free(n, a.off), -EINVAL);
    cr_expect_eq(nvme_read(n, a.off, buf, PAGE), -EINVAL);
    free(buf);
    nvme_close(n);
    uring_close(u);
}

Test(nvme, keep_reopens_data_one_dir)
{
    keep_reopens_data(1);
}
Test(nvme, keep_reopens_data_two_dirs)
{
    keep_reopens_data(2);
}

/* A swap space that grew on demand reopens at its grown size and keeps growing. */
Test(nvme, keep_then_grow_on_demand)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = NULL;
    struct nvme_stats st;
    struct nvme_opts o = {.dirs = dirs, .ndirs = 2};
    struct ext a = {.len = MiB + PAGE, .seed = 31}, b = {.len = 3 * PAGE, .seed = 32};
    uint64_t big;

    cr_assert_eq(nvme_open(&o, u, &n), 0);
    cr_assert_eq(nvme_alloc(n, a.len, &a.off), 0);
    cr_assert_eq(nvme_alloc(n, b.len, &b.off), 0);
    write_ext(n, &a);
    write_ext(n, &b);
    nvme_close(n);

    cr_assert_eq(open_kept(u, dirs, 2, 0, &n), 0);
    nvme_get_stats(n, &st);
    cr_expect(st.growable);
    cr_expect_eq(st.capacity_bytes, 2 * NVME_GROW_MIN_BYTES);
    cr_expect_eq(st.grows, 0);
    cr_assert_eq(nvme_reserve(n, b.off, b.len), 0);
    cr_assert_eq(nvme_reserve(n, a.off, a.len), 0);
    /* Reserving never grows the space. */
    cr_expect_eq(nvme_reserve(n, st.capacity_bytes, PAGE), -EINVAL);
    cr_expect_eq(nvme_reserve(n, st.capacity_bytes - PAGE, 2 * PAGE), -EINVAL);
    /* More than is free: the files grow, from their kept size. */
    nvme_get_stats(n, &st);
    uint64_t want = st.free_bytes + MiB;
    cr_assert_eq(nvme_alloc(n, want, &big), 0);
    cr_expect_not(overlaps(big, want, a.off, a.len));
    cr_expect_not(overlaps(big, want, b.off, b.len));
    nvme_get_stats(n, &st);
    cr_expect_eq(st.grows, 1);
    cr_expect_eq(st.file_bytes, 2 * NVME_GROW_MIN_BYTES);
    cr_expect_eq(file_size(dir, 0), (int64_t)(2 * NVME_GROW_MIN_BYTES));
    cr_expect_eq(file_size(dir2, 1), (int64_t)(2 * NVME_GROW_MIN_BYTES));
    expect_ext(n, &a);
    expect_ext(n, &b);
    nvme_close(n);
    uring_close(u);
}

/* Where no swap file exists yet, keep creates them as a plain open does. */
Test(nvme, keep_in_fresh_directories_creates_files)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = NULL;
    struct nvme_stats st;
    struct ext e = {.len = 2 * BLOCK, .seed = 41};

    cr_assert_eq(open_kept(u, dirs, 2, MiB, &n), 0);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.capacity_bytes, MiB);
    cr_expect_eq(st.used_bytes, 0);
    cr_expect_eq(file_size(dir, 0), (int64_t)(MiB / 2));
    cr_expect_eq(file_size(dir2, 1), (int64_t)(MiB / 2));
    cr_assert_eq(nvme_alloc(n, e.len, &e.off), 0);
    write_ext(n, &e);
    nvme_close(n);

    /* A second keep open with the same options finds them and keeps the data. */
    cr_assert_eq(open_kept(u, dirs, 2, MiB, &n), 0);
    cr_assert_eq(nvme_reserve(n, e.off, e.len), 0);
    expect_ext(n, &e);
    nvme_close(n);
    uring_close(u);
}

/* A failed keep open in fresh directories removes the files it created: they hold nothing,
 * and left behind they would make the next keep open find a partial set. */
Test(nvme, keep_failed_fresh_open_removes_what_it_created)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    char *missing;
    struct nvme *n = NULL;

    cr_assert_geq(asprintf(&missing, "%s/does/not/exist", dir2), 0);
    const char *dirs[] = {dir, missing};
    test_log_capture_start();
    cr_expect_eq(open_kept(u, dirs, 2, MiB, &n), -ENOENT);
    cr_expect_null(n);
    cr_expect_eq(file_size(dir, 0), -1, "a failed fresh keep open left a swap file behind");
    free(missing);
    uring_close(u);
}

/* Make a two-file swap space with data in it and close it, keeping the files. */
static struct ext make_kept_pair(struct uring *u, const char *const *dirs, uint64_t cap)
{
    struct nvme *n = NULL;
    struct ext e = {.len = 3 * BLOCK, .seed = 51};
    struct nvme_opts o = {.dirs = dirs, .ndirs = 2, .capacity_bytes = cap};

    cr_assert_eq(nvme_open(&o, u, &n), 0);
    cr_assert_eq(nvme_alloc(n, e.len, &e.off), 0);
    write_ext(n, &e);
    nvme_close(n);
    return e;
}

/* A growth cut short by a crash (its fallocate ran out of space after extending some
 * files) leaves odd sizes: the reopen takes every file down to the whole stripes all of
 * them hold, and the data is there. A reader only leaves the rest unread. */
Test(nvme, keep_takes_odd_sizes_down_to_whole_stripes)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = NULL;
    struct ext e = make_kept_pair(u, dirs, 2 * MiB);
    char *p0 = swap_path(dir, 0), *p1 = swap_path(dir2, 1);
    struct nvme_stats st;

    /* File 1 grown by a whole stripe and some, file 0 by a page. */
    cr_assert_eq(truncate(p1, (off_t)(2 * MiB + 3 * PAGE)), 0);
    cr_assert_eq(truncate(p0, (off_t)(MiB + PAGE)), 0);
    struct nvme_opts ro = {.dirs = dirs, .ndirs = 2, .capacity_bytes = 2 * MiB, .keep = true,
                           .readonly = true};
    cr_assert_eq(nvme_open(&ro, u, &n), 0);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.file_bytes, MiB);
    cr_assert_eq(nvme_reserve(n, e.off, e.len), 0);
    expect_ext(n, &e);
    nvme_close(n);
    cr_expect_eq(file_size(dir, 0), (int64_t)(MiB + PAGE), "a reader cut a file");
    cr_expect_eq(file_size(dir2, 1), (int64_t)(2 * MiB + 3 * PAGE), "a reader cut a file");

    test_log_capture_start();
    cr_assert_eq(open_kept(u, dirs, 2, 2 * MiB, &n), 0);
    cr_expect_eq(log_lines_with(p1), 1, "the notice names the file: %s", test_log_text());
    test_log_capture_stop();
    cr_expect_eq(file_size(dir, 0), (int64_t)MiB);
    cr_expect_eq(file_size(dir2, 1), (int64_t)MiB);
    cr_assert_eq(nvme_reserve(n, e.off, e.len), 0);
    expect_ext(n, &e);
    nvme_close(n);
    free(p0);
    free(p1);
    uring_close(u);
}

Test(nvme, keep_missing_file_is_enoent)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = NULL;
    struct ext e = make_kept_pair(u, dirs, 2 * MiB);
    char *p0 = swap_path(dir, 0), *p1 = swap_path(dir2, 1), *moved;

    /* The second file missing. */
    cr_assert_geq(asprintf(&moved, "%s/moved", dir2), 0);
    cr_assert_eq(rename(p1, moved), 0);
    test_log_capture_start();
    cr_expect_eq(open_kept(u, dirs, 2, 2 * MiB, &n), -ENOENT);
    cr_expect_null(n);
    cr_expect_eq(log_lines_with(p1), 1, "the error names the missing file: %s", test_log_text());
    cr_expect_eq(file_size(dir, 0), (int64_t)MiB, "the remaining file was touched");
    cr_expect_eq(file_size(dir2, 1), -1, "the missing file was created");
    cr_assert_eq(rename(moved, p1), 0);

    /* The first file missing. */
    cr_assert_eq(rename(p0, moved), 0);
    test_log_capture_start();
    cr_expect_eq(open_kept(u, dirs, 2, 2 * MiB, &n), -ENOENT);
    cr_expect_eq(log_lines_with(p0), 1, "the error names the missing file: %s", test_log_text());
    cr_expect_eq(file_size(dir, 0), -1);
    cr_expect_eq(file_size(dir2, 1), (int64_t)MiB);
    cr_assert_eq(rename(moved, p0), 0);

    /* Both back: nothing was lost. */
    cr_assert_eq(open_kept(u, dirs, 2, 2 * MiB, &n), 0);
    cr_assert_eq(nvme_reserve(n, e.off, e.len), 0);
    expect_ext(n, &e);
    nvme_close(n);
    free(moved);
    free(p0);
    free(p1);
    uring_close(u);
}

/* keep on files another swap space holds: -EBUSY, and the holder's data is untouched. */
Test(nvme, keep_on_locked_files_is_ebusy)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct nvme *a = open_swap(u, dirs, 1, MiB, 0), *b = NULL;
    struct ext e = {.len = 64 * KiB, .seed = 61};

    cr_assert_eq(nvme_alloc(a, e.len, &e.off), 0);
    write_ext(a, &e);
    test_log_capture_start();
    cr_expect_eq(open_kept(u, dirs, 1, MiB, &b), -EBUSY);
    cr_expect_null(b);
    cr_expect_eq(file_size(dir, 0), (int64_t)MiB);
    expect_ext(a, &e);
    nvme_close(a);
    uring_close(u);
}

Test(nvme, reserve_bad_arguments)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct nvme *n = open_swap(u, dirs, 1, MiB, 0), *g = NULL;
    struct nvme_stats before, after;
    uint64_t off;

    cr_assert_eq(nvme_alloc(n, 2 * PAGE, &off), 0);
    nvme_get_stats(n, &before);
    cr_expect_eq(nvme_reserve(NULL, 64 * PAGE, PAGE), -EINVAL);
    cr_expect_eq(nvme_reserve(n, 64 * PAGE, 0), -EINVAL);
    cr_expect_eq(nvme_reserve(n, 64 * PAGE + 512, PAGE), -EINVAL); /* unaligned */
    cr_expect_eq(nvme_reserve(n, MiB, PAGE), -EINVAL);             /* beyond the capacity */
    cr_expect_eq(nvme_reserve(n, MiB - PAGE, 2 * PAGE), -EINVAL);  /* runs past it */
    cr_expect_eq(nvme_reserve(n, 0, UINT64_MAX), -EINVAL);
    cr_expect_eq(nvme_reserve(n, off, PAGE), -EEXIST);            /* a live allocation */
    cr_expect_eq(nvme_reserve(n, off + PAGE, 4 * PAGE), -EEXIST); /* runs into free space */
    nvme_get_stats(n, &after);
    cr_expect_eq(memcmp(&before, &after, sizeof(before)), 0);

    /* Rounded up to 4 KiB, like an allocation. */
    cr_assert_eq(nvme_reserve(n, 64 * PAGE, 1), 0);
    cr_expect_eq(nvme_reserve(n, 65 * PAGE, PAGE), 0);
    nvme_get_stats(n, &after);
    cr_expect_eq(after.used_bytes, before.used_bytes + 2 * PAGE);
    cr_expect_eq(nvme_free(n, 64 * PAGE), 0);
    cr_expect_eq(nvme_free(n, 65 * PAGE), 0);

    /* A growable space that has not grown has nothing to reserve yet. */
    const char *dirs2[] = {dir2};
    g = open_swap(u, dirs2, 1, 0, 0);
    cr_expect_eq(nvme_reserve(g, 0, PAGE), -EINVAL);
    nvme_close(g);
    nvme_close(n);
    uring_close(u);
}

/* ---- filesystems and fallbacks ------------------------------------------------------- */

Test(nvme, tmpfs)
{
    char *shm = test_shmdir("nvme");
    if (!shm) cr_skip_test("no /dev/shm");
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {shm, dir};
    struct nvme *n = open_swap(u, dirs, 2, 2 * MiB, 0);
    struct ext e = {.len = 3 * BLOCK + PAGE, .seed = 10};

    cr_assert_eq(nvme_alloc(n, e.len, &e.off), 0);
    write_ext(n, &e);
    expect_ext(n, &e);
    cr_expect_eq(nvme_sync(n), 0);
    cr_expect_eq(file_size(shm, 0), (int64_t)MiB);
    nvme_close(n);
    cr_expect_eq(file_size(shm, 0), -1);
    uring_close(u);
    test_rmtree(shm);
}

Test(nvme, buffered_fallback)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct nvme_stats st;
    struct uring_stats us;
    struct ext e = {.len = 5 * BLOCK + 3 * PAGE, .seed = 12};

    test_log_capture_start();
    uring_fault_set(u, URING_FAULT_NO_DIRECT, 1);
    struct nvme *n = open_swap(u, dirs, 1, 2 * MiB, 0);
    nvme_get_stats(n, &st);
    cr_expect_eq(st.buffered_files, 1);
    uring_get_stats(u, &us);
    cr_expect_eq(us.buffered_files, 1);
    cr_assert_eq(nvme_alloc(n, e.len, &e.off), 0);
    write_ext(n, &e);
    expect_ext(n, &e);
    cr_expect_eq(nvme_sync(n), 0);
    nvme_close(n);
    uring_get_stats(u, &us);
    cr_expect_eq(us.buffered_files, 0);
    uring_close(u);
}

/* ---- threads ----------------------------------------------------------------------- */

struct worker {
    struct nvme *n;
    uint64_t seed;
    int err;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    uint64_t s = w->seed;
    void *buf = test_aligned_alloc(64 * PAGE), *want = test_aligned_alloc(64 * PAGE);

    for (unsigned i = 0; i < 60 && !w->err; i++) {
        uint64_t len = odd_size(&s, 64), off, seed = test_rand(&s);
        int r = nvme_alloc(w->n, len, &off);
        if (r == 0) {
            test_fill_random(want, len, seed);
            r = nvme_write(w->n, off, want, len);
        }
        if (r == 0) r = nvme_read(w->n, off, buf, len);
        if (r == 0 && memcmp(buf, want, len) != 0) r = -EILSEQ;
        if (r == 0 && i % 4 != 3) /* keep a quarter */
            r = nvme_free(w->n, off);
        w->err = r;
    }
    free(buf);
    free(want);
    return NULL;
}

Test(nvme, concurrent_callers)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir, dir2};
    struct nvme *n = open_swap(u, dirs, 2, 0, 0);
    enum { T = 4 };
    pthread_t th[T];
    struct worker w[T];

    for (unsigned i = 0; i < T; i++) {
        w[i] = (struct worker){.n = n, .seed = 100 + i};
        cr_assert_eq(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
    }
    for (unsigned i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        cr_expect_eq(w[i].err, 0, "thread %u: %s", i, strerror(-w[i].err));
    }
    struct nvme_stats st;
    nvme_get_stats(n, &st);
    cr_expect_eq(st.used_extents, T * 15);
    nvme_close(n);
    uring_close(u);
}

Test(nvme, stripe_unit_must_be_a_power_of_two)
{
    char *d = test_tmpdir("nvme-pow2");
    struct uring *u = NULL;
    struct uring_opts uo = {.block_size = 64 * 1024, .queue_depth = 4};
    struct nvme *n = NULL;
    const char *dirs[] = {d};
    struct nvme_opts o = {.dirs = dirs, .ndirs = 1, .block_size = 12 * 1024};

    cr_assert_eq(uring_open(&uo, &u), 0);
    test_log_capture_start();
    cr_assert_eq(nvme_open(&o, u, &n), -EINVAL);
    cr_assert(strstr(test_log_text(), "power of two") != NULL, "%s", test_log_text());
    test_log_capture_stop();
    cr_assert_null(n);
    uring_close(u);
    test_rmtree(d);
}

/* Starting over on swap files a manifest names: the manifest must go before their bytes
 * do. The files used to be truncated first, so a crash in between left a manifest naming
 * bytes that were gone. Here its removal fails (it is a directory), and the files must
 * still hold what they held; when it can be removed, it is gone and the files are empty. */
Test(nvme, start_over_removes_the_manifest_before_emptying_the_files)
{
    struct uring *u = open_engine(URING_BACKEND_AUTO);
    const char *dirs[] = {dir};
    struct nvme_opts ko = {.dirs = dirs, .ndirs = 1, .capacity_bytes = 256 * KiB};
    struct nvme *n = NULL;
    cr_assert_eq(nvme_open(&ko, u, &n), 0); /* files kept at close */
    char *buf = test_aligned_alloc(64 * KiB);
    uint64_t off;
    cr_assert_eq(nvme_alloc(n, 64 * KiB, &off), 0);
    memset(buf, 0x5a, 64 * KiB);
    cr_assert_eq(nvme_write(n, off, buf, 64 * KiB), 0);
    cr_assert_eq(nvme_sync(n), 0);
    nvme_close(n);
    int64_t size = file_size(dir, 0);
    cr_assert_gt(size, 0);

    char *manifest;
    cr_assert_geq(asprintf(&manifest, "%s/manifest", dir), 0);
    cr_assert_eq(mkdir(manifest, 0700), 0);
    char *inside;
    cr_assert_geq(asprintf(&inside, "%s/x", manifest), 0);
    FILE *f = fopen(inside, "w");
    cr_assert_not_null(f);
    fclose(f);
    ko.remove_before_truncate = manifest;
    test_log_capture_start();
    int r = nvme_open(&ko, u, &n);
    cr_assert_lt(r, 0, "the manifest could not be removed: the open fails");
    cr_assert(log_lines_with("left as they were") == 1, "%s", test_log_text());
    test_log_capture_stop();
    cr_assert_eq(file_size(dir, 0), size, "the swap file was emptied anyway");
    cr_assert_eq(nvme_open(&(struct nvme_opts){.dirs = dirs, .ndirs = 1, .keep = true}, u, &n),
                 0);
    char *back = test_aligned_alloc(64 * KiB);
    cr_assert_eq(nvme_reserve(n, off, 64 * KiB), 0); /* what the manifest would name */
    cr_assert_eq(nvme_read(n, off, back, 64 * KiB), 0);
    cr_assert_eq(memcmp(back, buf, 64 * KiB), 0, "the bytes the manifest named are gone");
    nvme_close(n);

    /* Removable: gone, and the files start empty (preallocated anew). */
    cr_assert_eq(unlink(inside), 0);
    cr_assert_eq(rmdir(manifest), 0);
    f = fopen(manifest, "w");
    cr_assert_not_null(f);
    fclose(f);
    ko.remove_on_close = true;
    cr_assert_eq(nvme_open(&ko, u, &n), 0);
    cr_assert_eq(access(manifest, F_OK), -1, "the manifest is still there");
    cr_assert_eq(nvme_reserve(n, off, 64 * KiB), 0);
    cr_assert_eq(nvme_read(n, off, back, 64 * KiB), 0);
    cr_assert_eq(memchr(back, 0x5a, 64 * KiB), NULL, "old bytes survived the start over");
    nvme_close(n);
    free(inside);
    free(manifest);
    free(back);
    free(buf);
    uring_close(u);
}
