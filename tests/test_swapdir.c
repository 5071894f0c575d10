/*
 * test_swapdir.c - the swap directory is the caller's data (engine_open in
 * src/engine/engine.c, the read-only swap space of src/tiers/nvme.c): a plain open of a
 * directory that holds a saved state is refused with -EEXIST and changes no byte;
 * ZINF_OPEN_OVERWRITE starts over; a missing nvme_path is created; RESUME and READONLY on
 * a directory without a saved run answer -ENOENT and create nothing; READONLY reads a
 * saved state, refuses every change with -EROFS, changes no byte, and works next to an
 * engine that holds the directory open, even one that flushes all the time. Every folder
 * an open or the daemon (src/service/folders.c) makes has its parent synced after it, so
 * that a power loss cannot take it away.
 *
 * Each fix has its success and its error twin. "Changes no byte" is checked by digesting
 * every file of the directory before and after. The device tier is emulated.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "helpers.h"
#include "service/folders.h"
#include "zinf.h"

#define BLOCK (64 * KiB)

static char *dir;

static void setup(void)
{
    dir = test_tmpdir("swapdir");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    test_log_capture_stop();
    test_leak_check();
    test_rmtree(dir);
    dir = NULL;
}

TestSuite(swapdir, .init = setup, .fini = teardown, .timeout = 120);

static int open_in(const char *path, unsigned flags, zinf_engine **e)
{
    struct zinf_options o = {.nvme_path = path,
                             .device_bytes = 4 * MiB,
                             .host_bytes = 4 * MiB,
                             .block_size = BLOCK,
                             .queue_depth = 8,
                             .device_kind = ZINF_DEVICE_EMULATED,
                             .flags = flags};
    *e = NULL;
    return zinf_open(&o, e);
}

static zinf_engine *open_ok(const char *path, unsigned flags)
{
    zinf_engine *e;
    int r = open_in(path, flags, &e);
    cr_assert_eq(r, 0, "zinf_open(%s, %#x): %s", path, flags, zinf_strerror(r));
    return e;
}

static zinf_tensor look(zinf_engine *e, const char *name)
{
    zinf_tensor t = 0;
    int r = zinf_lookup(e, name, &t);
    cr_assert_eq(r, 0, "lookup %s: %s", name, zinf_strerror(r));
    return t;
}

/* "name size fnv64" for every file of d, sorted by name: equal strings, equal bytes. */
static char *digest(const char *d)
{
    struct dirent **ents;
    int n = scandir(d, &ents, NULL, alphasort);
    cr_assert_geq(n, 0, "%s: %s", d, strerror(errno));
    size_t cap = 256 + (size_t)n * 128, len = 0;
    char *out = malloc(cap);
    cr_assert_not_null(out);
    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", d, ents[i]->d_name);
        struct stat st;
        if (ents[i]->d_name[0] != '.' && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
            FILE *f = fopen(path, "rb");
            cr_assert_not_null(f, "%s", path);
            /* FNV-1a over 8-byte words (swap files are whole pages; a tail is zero-padded). */
            static uint64_t buf[(1 << 20) / 8];
            uint64_t h = 0xcbf29ce484222325ull;
            size_t got;
            while ((got = fread(buf, 1, sizeof(buf), f)) > 0) {
                memset((char *)buf + got, 0, (8 - got % 8) % 8);
                for (size_t k = 0; k < (got + 7) / 8; k++)
                    h = (h ^ buf[k]) * 0x100000001b3ull;
            }
            fclose(f);
            len += (size_t)snprintf(out + len, cap - len, "%s %lld %016llx\n", ents[i]->d_name,
                                    (long long)st.st_size, (unsigned long long)h);
        }
        free(ents[i]);
    }
    free(ents);
    return out;
}

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

static unsigned count_entries(const char *d)
{
    unsigned n = 0;
    DIR *dd = opendir(d);
    cr_assert_not_null(dd, "%s", d);
    for (struct dirent *de; (de = readdir(dd));)
        n += de->d_name[0] != '.';
    closedir(dd);
    return n;
}

#define N_A (100 * KiB + 3)
#define N_B 5000

/* A saved state in dir: "a" (NVMe home) and "b" (host home) with known bytes. */
static void make_saved_state(unsigned char **a, unsigned char **b)
{
    zinf_engine *e = open_ok(dir, 0);
    *a = test_rand_buf(N_A, 1);
    *b = test_rand_buf(N_B, 2);
    zinf_tensor ta = test_register(e, "a", N_A, ZINF_TIER_NVME);
    zinf_tensor tb = test_register(e, "b", N_B, ZINF_TIER_HOST);
    cr_assert_eq(zinf_write(e, ta, 0, *a, N_A), 0);
    cr_assert_eq(zinf_write(e, tb, 0, *b, N_B), 0);
    zinf_close(e); /* flushes */
}

static void expect_saved_state(zinf_engine *e, const unsigned char *a, const unsigned char *b)
{
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors, 2);
    test_expect_content(e, look(e, "a"), a, N_A, "a");
    test_expect_content(e, look(e, "b"), b, N_B, "b");
}

/* ---- a plain open never deletes a saved state ---------------------------------------- */

/* It used to: the manifest was removed and the swap file truncated, silently. */
Test(swapdir, plain_open_of_a_saved_state_is_eexist_and_changes_nothing)
{
    unsigned char *a, *b;
    make_saved_state(&a, &b);
    char *before = digest(dir);

    zinf_engine *e = (zinf_engine *)1;
    test_log_capture_start();
    cr_assert_eq(open_in(dir, 0, &e), -EEXIST);
    cr_assert_null(e);
    const char *log = test_log_text();
    cr_assert(strstr(log, dir) && strstr(log, "ZINF_OPEN_RESUME") &&
                  strstr(log, "ZINF_OPEN_READONLY") && strstr(log, "ZINF_OPEN_OVERWRITE") &&
                  strstr(log, "2 tensors"),
              "one line names the directory, the state and the flags: %s", log);
    const char *eol = strchr(log, '\n');
    cr_assert(!eol || !eol[1], "one line: %s", log);
    test_log_capture_stop();
    /* NO_PIN is no reason to start over either. */
    cr_assert_eq(open_in(dir, ZINF_OPEN_NO_PIN, &e), -EEXIST);
    char *after = digest(dir);
    cr_assert_str_eq(before, after, "the refused open changed the directory");

    /* The state is still there to resume. */
    e = open_ok(dir, ZINF_OPEN_RESUME);
    expect_saved_state(e, a, b);
    zinf_close(e);
    free(before);
    free(after);
    free(a);
    free(b);
}

Test(swapdir, overwrite_starts_over)
{
    unsigned char *a, *b;
    make_saved_state(&a, &b);
    zinf_engine *e = open_ok(dir, ZINF_OPEN_OVERWRITE);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors, 0);
    zinf_tensor t;
    cr_assert_eq(zinf_lookup(e, "a", &t), -ENOENT);
    zinf_close(e);
    /* What it left is an empty state, which a plain open may start over again. */
    e = open_ok(dir, ZINF_OPEN_RESUME);
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors, 0);
    zinf_close(e);
    e = open_ok(dir, 0);
    zinf_close(e);
    free(a);
    free(b);
}

/* Nothing to protect: an empty directory, an empty state, swap files no manifest names
 * (a run killed before its first flush). */
Test(swapdir, plain_open_where_nothing_is_saved_starts_empty)
{
    zinf_engine *e = open_ok(dir, 0);
    zinf_close(e); /* leaves a manifest that names no tensor */
    e = open_ok(dir, 0);
    zinf_tensor t = test_register(e, "t", 4096, ZINF_TIER_NVME);
    cr_assert_eq(zinf_write(e, t, 0, "x", 1), 0);
    zinf_close(e);
    char path[4096];
    snprintf(path, sizeof(path), "%s/zinf-manifest.json", dir);
    cr_assert_eq(unlink(path), 0);
    e = open_ok(dir, 0);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors, 0);
    zinf_close(e);
}

/* A manifest that cannot be parsed may be the only record of what the files hold: a plain
 * open refuses it too (OVERWRITE takes it). */
Test(swapdir, unreadable_manifest_counts_as_a_saved_state)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/zinf-manifest.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{\"format\": \"zinf-manifest\", \"tens", f);
    fclose(f);
    zinf_engine *e;
    test_log_capture_start();
    cr_assert_eq(open_in(dir, 0, &e), -EEXIST);
    cr_assert(strstr(test_log_text(), "unreadable manifest"), "%s", test_log_text());
    test_log_capture_stop();
    e = open_ok(dir, ZINF_OPEN_OVERWRITE);
    zinf_close(e);
}

/* ---- a missing nvme_path ---------------------------------------------------------------- */

Test(swapdir, missing_nvme_path_is_created_with_its_parents)
{
    char path[4096], extra[4096];
    snprintf(path, sizeof(path), "%s/a/b/c", dir);
    snprintf(extra, sizeof(extra), "%s/x/y", dir);
    const char *extras[] = {extra, NULL};
    struct zinf_options o = {.nvme_path = path,
                             .nvme_paths_extra = extras,
                             .device_bytes = 4 * MiB,
                             .host_bytes = 4 * MiB,
                             .block_size = BLOCK,
                             .device_kind = ZINF_DEVICE_EMULATED};
    zinf_engine *e = NULL;
    int r = zinf_open(&o, &e);
    cr_assert_eq(r, 0, "%s", zinf_strerror(r));
    zinf_tensor t = test_register(e, "t", 3 * BLOCK, ZINF_TIER_NVME);
    cr_assert_eq(zinf_write(e, t, 0, "hello", 5), 0);
    zinf_close(e);
    cr_assert(exists(path) && exists(extra));
    o.flags = ZINF_OPEN_RESUME;
    cr_assert_eq(zinf_open(&o, &e), 0);
    unsigned char got[5];
    cr_assert_eq(zinf_read(e, look(e, "t"), 0, got, 5), 0);
    cr_assert_eq(memcmp(got, "hello", 5), 0);
    zinf_close(e);
}

/* ---- every folder made survives a power loss -------------------------------------------- */

/* This program is linked with -Wl,--wrap=fsync: every fsync of the library comes here first.
 * A folder's entry is durable once its parent is synced after the folder was made; for each
 * watched folder, that is noted when it happens. */
int __real_fsync(int fd);
int __wrap_fsync(int fd);

#define WATCH_MAX 8
static const char *watched[WATCH_MAX];
static atomic_bool parent_synced[WATCH_MAX];

int __wrap_fsync(int fd)
{
    struct stat st, pst, cst;
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        for (int i = 0; i < WATCH_MAX && watched[i]; i++) {
            char parent[4096];
            snprintf(parent, sizeof(parent), "%s", watched[i]);
            *strrchr(parent, '/') = '\0';
            if (stat(parent, &pst) == 0 && pst.st_dev == st.st_dev && pst.st_ino == st.st_ino &&
                lstat(watched[i], &cst) == 0)
                atomic_store(&parent_synced[i], true);
        }
    }
    return __real_fsync(fd);
}

static void watch(const char *const *paths)
{
    for (int i = 0; i < WATCH_MAX; i++) {
        watched[i] = paths[i];
        atomic_store(&parent_synced[i], false);
        if (!paths[i]) break;
        cr_assert(!exists(paths[i]), "%s is there already", paths[i]);
    }
}

static void expect_durable(const char *what)
{
    for (int i = 0; i < WATCH_MAX && watched[i]; i++) {
        cr_assert(exists(watched[i]), "%s: %s was not made", what, watched[i]);
        cr_expect(atomic_load(&parent_synced[i]),
                  "%s: %s was made but its parent was never synced after: a power loss can take "
                  "it (and all saved in it) away",
                  what, watched[i]);
    }
    watched[0] = NULL;
}

/* A missing nvme_path, the folders above it and an extra swap directory were made with
 * mkdir alone: after a power loss the folder, and the whole run saved in it, could vanish. */
Test(swapdir, every_folder_an_open_makes_has_its_parent_synced)
{
    char a[4096], ab[4200], path[4300], x[4096], extra[4200];
    snprintf(a, sizeof(a), "%s/a", dir);
    snprintf(ab, sizeof(ab), "%s/b", a);
    snprintf(path, sizeof(path), "%s/swap", ab);
    snprintf(x, sizeof(x), "%s/x", dir);
    snprintf(extra, sizeof(extra), "%s/extra", x);
    const char *made[] = {a, ab, path, x, extra, NULL};
    const char *extras[] = {extra, NULL};
    struct zinf_options o = {.nvme_path = path,
                             .nvme_paths_extra = extras,
                             .device_bytes = 4 * MiB,
                             .host_bytes = 4 * MiB,
                             .block_size = BLOCK,
                             .device_kind = ZINF_DEVICE_EMULATED};
    zinf_engine *e = NULL;
    watch(made);
    int r = zinf_open(&o, &e);
    cr_assert_eq(r, 0, "%s", zinf_strerror(r));
    zinf_close(e);
    expect_durable("zinf_open");
}

/* The daemon's swap directories (and the folders above them) and a job's folder under each. */
Test(swapdir, every_folder_the_daemon_makes_has_its_parent_synced)
{
    char srv[4096], root[4200], root2[4200], job[4300], job2[4300], err[1024];
    snprintf(srv, sizeof(srv), "%s/srv", dir);
    snprintf(root, sizeof(root), "%s/root", srv);
    snprintf(root2, sizeof(root2), "%s/root2", srv);
    snprintf(job, sizeof(job), "%s/job1", root);
    snprintf(job2, sizeof(job2), "%s/job1", root2);
    const char *roots_made[] = {srv, root, root2, NULL};
    watch(roots_made);
    cr_assert_eq(folders_check_root(root, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(folders_check_root(root2, err, sizeof(err)), 0, "%s", err);
    expect_durable("folders_check_root");
    const char *jobs_made[] = {job, job2, NULL};
    struct config_paths roots = {.path = {root, root2}, .count = 2};
    uid_t owner;
    watch(jobs_made);
    cr_assert_eq(folders_job(&roots, "job1", geteuid(), &owner), 0);
    expect_durable("folders_job");
}

Test(swapdir, nvme_path_that_cannot_be_created_is_refused)
{
    char file[4096], path[4200];
    snprintf(file, sizeof(file), "%s/plainfile", dir);
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fclose(f);
    snprintf(path, sizeof(path), "%s/sub", file);
    zinf_engine *e;
    test_log_capture_start();
    int r = open_in(path, 0, &e);
    cr_assert_eq(r, -ENOTDIR, "%s", zinf_strerror(r));
    cr_assert(strstr(test_log_text(), path), "the log names it: %s", test_log_text());
    test_log_capture_stop();
    cr_assert_eq(open_in(file, 0, &e), -ENOTDIR, "nvme_path is a file");
}

/* ---- RESUME and READONLY want a saved run ---------------------------------------------- */

/* They used to create an empty directory's swap file (RESUME) and start empty. */
static void no_saved_run(unsigned flags)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/nothing/here", dir);
    zinf_engine *e = (zinf_engine *)1;
    test_log_capture_start();
    cr_assert_eq(open_in(path, flags, &e), -ENOENT);
    cr_assert_null(e);
    char want[4200];
    snprintf(want, sizeof(want), "no saved run in %s", path);
    cr_assert(strstr(test_log_text(), want), "%s", test_log_text());
    test_log_capture_stop();
    cr_assert(!exists(path), "a missing directory is not created");

    /* An existing directory without a manifest: the same, and nothing is created in it. */
    test_log_capture_start();
    cr_assert_eq(open_in(dir, flags, &e), -ENOENT);
    snprintf(want, sizeof(want), "no saved run in %s", dir);
    cr_assert(strstr(test_log_text(), want), "%s", test_log_text());
    test_log_capture_stop();
    cr_assert_eq(count_entries(dir), 0, "nothing was created in %s", dir);
}

Test(swapdir, resume_without_a_saved_run_is_enoent_and_creates_nothing)
{
    no_saved_run(ZINF_OPEN_RESUME);
    /* The success twin: with a saved run it resumes (make_saved_state's open is plain). */
    unsigned char *a, *b;
    make_saved_state(&a, &b);
    zinf_engine *e = open_ok(dir, ZINF_OPEN_RESUME);
    expect_saved_state(e, a, b);
    zinf_close(e);
    free(a);
    free(b);
}

Test(swapdir, readonly_without_a_saved_run_is_enoent_and_creates_nothing)
{
    no_saved_run(ZINF_OPEN_READONLY);
    no_saved_run(ZINF_OPEN_READONLY | ZINF_OPEN_RESUME);
}

Test(swapdir, contradictory_flags_are_einval)
{
    zinf_engine *e;
    cr_assert_eq(open_in(dir, ZINF_OPEN_READONLY | ZINF_OPEN_OVERWRITE, &e), -EINVAL);
    cr_assert_eq(open_in(dir, ZINF_OPEN_RESUME | ZINF_OPEN_OVERWRITE, &e), -EINVAL);
    cr_assert_eq(open_in(NULL, ZINF_OPEN_READONLY, &e), -EINVAL, "read-only without a directory");
    cr_assert_eq(count_entries(dir), 0);
    /* OVERWRITE alone on a fresh directory is a plain start. */
    e = open_ok(dir, ZINF_OPEN_OVERWRITE);
    zinf_close(e);
}

/* ---- READONLY ----------------------------------------------------------------------------- */

Test(swapdir, readonly_reads_the_state_refuses_changes_and_changes_no_byte)
{
    unsigned char *a, *b;
    make_saved_state(&a, &b);
    char *before = digest(dir);

    zinf_engine *e = open_ok(dir, ZINF_OPEN_READONLY);
    expect_saved_state(e, a, b);
    zinf_tensor ta = look(e, "a"), tb = look(e, "b"), x;
    /* Fetches work in both memory tiers; a dirty release is refused and keeps its pin. */
    for (int tier = 0; tier < 2; tier++) {
        void *p;
        cr_assert_eq(zinf_fetch(e, ta, tier, &p), 0);
        cr_assert_eq(memcmp(p, a, N_A), 0);
        cr_assert_eq(zinf_release(e, ta, tier, ZINF_RELEASE_DIRTY), -EROFS);
        cr_assert_eq(zinf_release(e, ta, tier, 0), 0, "the pin was kept");
        cr_assert_eq(zinf_release(e, ta, tier, 0), -EINVAL, "and only one");
    }
    cr_assert_eq(zinf_register(e, "new", 100, ZINF_TIER_HOST, &x), -EROFS);
    cr_assert_eq(zinf_register(e, "new", 100, ZINF_TIER_NVME, &x), -EROFS);
    cr_assert_eq(zinf_write(e, tb, 0, "zz", 2), -EROFS);
    cr_assert_eq(zinf_unregister(e, tb), -EROFS);
    cr_assert_eq(zinf_flush(e), -EROFS);
    cr_assert_eq(zinf_step(e), 0);
    cr_assert_eq(strcmp(zinf_strerror(-EROFS), strerror(EROFS)) != 0, 1, "zinf says why");
    expect_saved_state(e, a, b);
    zinf_close(e);

    char *after = digest(dir);
    cr_assert_str_eq(before, after, "the read-only engine changed the directory");
    /* And the state is as resumable as before. */
    e = open_ok(dir, ZINF_OPEN_RESUME | ZINF_OPEN_READONLY);
    expect_saved_state(e, a, b);
    zinf_close(e);
    e = open_ok(dir, ZINF_OPEN_RESUME);
    expect_saved_state(e, a, b);
    zinf_close(e);
    free(before);
    free(after);
    free(a);
    free(b);
}

/* The swap files are locked by the engine that has them open; a reader takes no lock. It
 * used to be refused (-EBUSY) by that lock. */
Test(swapdir, readonly_works_next_to_an_engine_that_holds_the_directory)
{
    unsigned char *a, *b;
    make_saved_state(&a, &b);
    zinf_engine *w = open_ok(dir, ZINF_OPEN_RESUME);
    /* The writer changes "b" and flushes: the reader sees the flushed state. */
    unsigned char *b2 = test_rand_buf(N_B, 3);
    cr_assert_eq(zinf_write(w, look(w, "b"), 0, b2, N_B), 0);
    cr_assert_eq(zinf_flush(w), 0);
    char *before = digest(dir);

    zinf_engine *e = open_ok(dir, ZINF_OPEN_READONLY);
    expect_saved_state(e, a, b2);
    zinf_close(e);
    char *after = digest(dir);
    cr_assert_str_eq(before, after, "the reader changed the directory");

    /* A second writer is still kept off (the reader did not weaken the lock). */
    zinf_engine *w2;
    test_log_capture_start();
    cr_assert_eq(open_in(dir, ZINF_OPEN_RESUME, &w2), -EBUSY);
    test_log_capture_stop();
    /* The writer goes on as if nothing happened. */
    cr_assert_eq(zinf_write(w, look(w, "a"), 0, b2, 100), 0);
    memcpy(a, b2, 100);
    zinf_close(w);
    e = open_ok(dir, ZINF_OPEN_RESUME);
    expect_saved_state(e, a, b2);
    zinf_close(e);
    free(before);
    free(after);
    free(a);
    free(b);
    free(b2);
}

#define N_F (512 * KiB)
#define OPENS 100

struct flusher {
    zinf_engine *e;
    atomic_bool stop;
    unsigned flushes;
};

static void *flush_loop(void *arg)
{
    struct flusher *f = arg;
    zinf_tensor t[4];
    unsigned char *buf = malloc(N_F);
    for (int i = 0; i < 4; i++) {
        char name[8];
        snprintf(name, sizeof(name), "f%d", i);
        if (zinf_lookup(f->e, name, &t[i]) < 0) abort();
    }
    for (uint64_t v = 10; !atomic_load(&f->stop); v++) {
        test_fill_random(buf, N_F, v);
        buf[0] = (unsigned char)v;
        for (int i = 0; i < 4; i++)
            if (zinf_write(f->e, t[i], 0, buf, N_F) < 0) abort();
        if (zinf_flush(f->e) < 0) abort();
        f->flushes++;
        /* A job checkpoints now and then, not without a pause: the reader must get a
         * chance (it tries again while the state keeps being replaced, a bounded number
         * of times). */
        usleep(2000);
    }
    free(buf);
    return NULL;
}

/* A job that replaces its state all the time reuses the extents an older manifest named:
 * a reader that read such a manifest finds a checksum that does not match, sees that the
 * manifest changed, and reads the new one. Every open succeeds and sees one whole state. */
Test(swapdir, readonly_next_to_a_job_that_flushes_all_the_time_always_opens)
{
    /* On tmpfs, where fdatasync costs nothing, the job flushes often enough to race. */
    char *shm = test_shmdir("swapdir");
    if (shm) {
        test_rmtree(dir);
        dir = shm;
    }
    zinf_engine *w = open_ok(dir, 0);
    for (int i = 0; i < 4; i++) {
        char name[8];
        snprintf(name, sizeof(name), "f%d", i);
        test_register(w, name, N_F, i % 2 ? ZINF_TIER_HOST : ZINF_TIER_NVME);
    }
    cr_assert_eq(zinf_flush(w), 0);
    struct flusher f = {.e = w};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, flush_loop, &f), 0);
    unsigned char *got = malloc(N_F);
    test_log_capture_start();
    for (int k = 0; k < OPENS; k++) {
        zinf_engine *e;
        int r = open_in(dir, ZINF_OPEN_READONLY, &e);
        cr_assert_eq(r, 0, "read-only open %d next to a flushing job: %s", k, zinf_strerror(r));
        /* The host-homed tensors were loaded at open and checked: one version for both. */
        cr_assert_eq(zinf_read(e, look(e, "f1"), 0, got, 1), 0);
        unsigned char v1 = got[0];
        cr_assert_eq(zinf_read(e, look(e, "f3"), 0, got, 1), 0);
        cr_assert_eq(got[0], v1, "open %d: f1 from version %u, f3 from %u", k, v1, got[0]);
        zinf_close(e);
    }
    unsigned retries = 0;
    for (const char *l = test_log_text(); (l = strstr(l, "replaced while it was read")); l++)
        retries++;
    test_log_capture_stop();
    atomic_store(&f.stop, true);
    pthread_join(th, NULL);
    cr_log_info("%u flushes during %d read-only opens, %u of which read a newer state again",
                f.flushes, OPENS, retries);
    zinf_close(w);
    free(got);
}

/* ---- the same through a config file ----------------------------------------------------- */

static char *write_config(void)
{
    char *path;
    cr_assert_geq(asprintf(&path, "%s.json", dir), 0);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\", \"pin_memory\": false}},\n"
            " \"aio\": {\"block_size\": %zu, \"queue_depth\": 8},\n"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": %zu, \"host_bytes\": %zu}}\n",
            dir, (size_t)BLOCK, (size_t)4 * MiB, (size_t)4 * MiB);
    fclose(f);
    return path;
}

/* zinf_open_config takes no flags, so a caller with only a config could neither resume
 * nor start over a saved state, which a plain open now refuses: zinf_open_config_flags. */
Test(swapdir, config_open_takes_the_same_flags)
{
    unsigned char *a, *b;
    make_saved_state(&a, &b);
    char *cfg = write_config();
    zinf_engine *e = (zinf_engine *)1;

    cr_assert_eq(zinf_open_config(cfg, &e), -EEXIST);
    cr_assert_null(e);
    cr_assert_eq(zinf_open_config_flags(cfg, 1u << 30, &e), -EINVAL);
    cr_assert_eq(zinf_open_config_flags(cfg, ZINF_OPEN_READONLY, &e), 0);
    expect_saved_state(e, a, b);
    zinf_close(e);
    cr_assert_eq(zinf_open_config_flags(cfg, ZINF_OPEN_RESUME, &e), 0);
    expect_saved_state(e, a, b);
    zinf_close(e);
    cr_assert_eq(zinf_open_config_flags(cfg, ZINF_OPEN_OVERWRITE, &e), 0);
    struct zinf_stats st;
    cr_assert_eq(zinf_stats(e, &st), 0);
    cr_assert_eq(st.tensors, 0);
    zinf_close(e);
    unlink(cfg);
    free(cfg);
    free(a);
    free(b);
}
