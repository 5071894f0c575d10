/*
 * persist.c - durability: zinf_flush writes every tensor's newest content to the swap
 * space, fsyncs the swap files and replaces a manifest (name, size, home, extent,
 * crc32c per tensor) atomically; ZINF_OPEN_RESUME reads it back and checks every
 * checksum.
 *
 * Crash safety rests on one rule: an extent named by the committed manifest (or by the
 * one a flush is writing, which a crash may leave committed) is never written. New content
 * goes to another extent (copy on write, here, in zinf_write and in write-backs); the old
 * one is freed only once a newer manifest no longer names it. A crash at any
 * moment therefore leaves the old manifest with the old bytes, or the new one with the
 * new bytes: each tensor is whole, old or new.
 *
 * Two versions (persist_flush_tagged with keep). Ranks that checkpoint together commit a
 * step only once every rank has saved it, so each keeps its previous manifest, as
 * zinf-manifest.json.prev, until then. The previous manifest's extents are retained:
 * not freed and not written, as the committed one's (they are no tensor's any more, so no
 * write can reach them), until persist_drop_previous or a flush that keeps no previous
 * version frees them. A committing flush that keeps the previous one renames the current
 * manifest over .prev and then the new one into place; a crash between the two renames
 * leaves .prev alone, which then counts as the current one. Resume takes the current
 * manifest and forgets .prev, or (ENGINE_OPEN_PREVIOUS) rolls back to .prev, which takes the
 * current one's place. A manifest carries the tag its flush was given (the trainer's step;
 * -1: none), which persist_versions reads without opening anything; a flush that saves the
 * same state as the committed manifest keeps its tag.
 *
 * Not here: the swap layout (nvme.c) or when to write back (fetch.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tiers/nvme.h"
#include "trace.h"

#define MANIFEST_NAME "zinf-manifest.json"
#define PREV_SUFFIX ".prev"
#define MANIFEST_FORMAT "zinf-manifest"
#define MANIFEST_VERSION 1
/* How long one flush waits in all for callers to release the copies that alone hold a
 * tensor's newest content (flush_reads_held). */
#define FLUSH_HELD_WAIT_NS (200 * 1000000ull)

/* ---- crc32c (Castagnoli) ------------------------------------------------------------ */

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int k = 1; k < 8; k++)
            crc_table[k][i] = (crc_table[k - 1][i] >> 8) ^ crc_table[0][crc_table[k - 1][i] & 0xff];
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p,
                                                         size_t n)
{
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
    }
    uint32_t c32 = (uint32_t)c;
    for (; n; n--)
        c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

static uint32_t crc_sw(uint32_t c, const unsigned char *p, size_t n)
{
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
            crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xff] ^
            crc_table[2][(hi >> 8) & 0xff] ^ crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
    }
    for (; n; n--)
        c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return c;
}

uint32_t crc32c(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&crc_once, crc_init);
    crc = ~crc;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("sse4.2"))
        return ~crc_hw(crc, buf, len);
#endif
    return ~crc_sw(crc, buf, len);
}

/* crc32c(A || B) from crc32c(A), crc32c(B) and |B|: multiply crc1 by x^(8|B|) in GF(2). */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    for (int i = 0; vec; i++, vec >>= 1)
        if (vec & 1)
            sum ^= mat[i];
    return sum;
}

static void gf2_square(uint32_t *sq, const uint32_t *mat)
{
    for (int n = 0; n < 32; n++)
        sq[n] = gf2_times(mat, mat[n]);
}

uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2)
{
    uint32_t even[32], odd[32];

    if (len2 == 0)
        return crc1;
    odd[0] = 0x82f63b78u; /* the operator for one zero bit */
    for (int n = 1; n < 32; n++)
        odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    do {
        gf2_square(even, odd);
        if (len2 & 1)
            crc1 = gf2_times(even, crc1);
        len2 >>= 1;
        if (!len2)
            break;
        gf2_square(odd, even);
        if (len2 & 1)
            crc1 = gf2_times(odd, crc1);
        len2 >>= 1;
    } while (len2);
    return crc1 ^ crc2;
}

/* ---- the manifest file ------------------------------------------------------------------ */

static void manifest_path(struct zinf_engine *e, char *buf, size_t len, const char *suffix)
{
    snprintf(buf, len, "%s/%s%s", e->nvme_dirs[0], MANIFEST_NAME, suffix);
}

/* Files in the manifest's folder are reached relative to it (openat, fstatat, renameat,
 * unlinkat with the file's name), never through a link in its place: the folder is opened
 * once, by the swap files' layer (an engine's) or here (a path given). dir_fd: that folder's
 * fd, or AT_FDCWD where there is none (then the whole path is used). */
static int engine_dir_fd(struct zinf_engine *e)
{
    int fd = nvme_dir_fd(e->nvme, 0);
    return fd >= 0 ? fd : AT_FDCWD;
}

static const char *rel(int dir_fd, const char *path)
{
    const char *slash = strrchr(path, '/');
    return dir_fd == AT_FDCWD || !slash ? path : slash + 1;
}

void persist_manifest_path(const char *dir, char *buf, size_t len)
{
    snprintf(buf, len, "%s/%s", dir, MANIFEST_NAME);
}

int persist_remove_manifest(struct zinf_engine *e)
{
    char path[4096];
    int dfd = engine_dir_fd(e);
    manifest_path(e, path, sizeof(path), PREV_SUFFIX);
    if (unlinkat(dfd, rel(dfd, path), 0) < 0 && errno != ENOENT)
        return -errno;
    manifest_path(e, path, sizeof(path), "");
    /* The swap files were just emptied: a manifest left from before names nothing now. */
    if (unlinkat(dfd, rel(dfd, path), 0) < 0 && errno != ENOENT)
        return -errno;
    return 0;
}

/* The manifest of dir that counts as the current one: zinf-manifest.json, or where a crash
 * came between the two renames of a flush keeping the previous version, the .prev one. */
static int current_manifest(int dfd, const char *dir, char *path, size_t len, struct stat *st)
{
    snprintf(path, len, "%s/%s", dir, MANIFEST_NAME);
    if (fstatat(dfd, rel(dfd, path), st, AT_SYMLINK_NOFOLLOW) == 0)
        return 0;
    int r = -errno;
    if (r != -ENOENT)
        return r;
    snprintf(path, len, "%s/%s%s", dir, MANIFEST_NAME, PREV_SUFFIX);
    return fstatat(dfd, rel(dfd, path), st, AT_SYMLINK_NOFOLLOW) == 0 ? 1 : -errno;
}

/* dir, opened for the *at() calls, or -errno. */
static int open_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    return fd >= 0 ? fd : -errno;
}

int persist_saved_at(const char *dir, struct timespec *when)
{
    char path[4096];
    struct stat st;
    int dfd = open_dir(dir);
    if (dfd < 0)
        return dfd;
    int r = current_manifest(dfd, dir, path, sizeof(path), &st);
    close(dfd);
    if (r < 0)
        return r;
    *when = st.st_mtim;
    return 0;
}

/* A file of the saved state, named name in dfd: this user's regular file (0), absent
 * (-ENOENT), or something else, which is not ours to remove (-EACCES). */
static int saved_file(int dfd, const char *name)
{
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return -errno;
    return S_ISREG(st.st_mode) && st.st_uid == geteuid() ? 0 : -EACCES;
}

ZINF_API int zinf_saved_remove(const char *dir, const char *const *extra)
{
    const char *dirs[NVME_MAX_DIRS];
    int dfd[NVME_MAX_DIRS], fd[NVME_MAX_DIRS], r = 0;
    char swap[NVME_MAX_DIRS][32];
    unsigned n = 0;
    if (!dir) return -EINVAL;
    dirs[n++] = dir;
    while (extra && extra[n - 1]) {
        if (n == NVME_MAX_DIRS) return -EINVAL; /* more directories than an engine opens */
        dirs[n] = extra[n - 1];
        n++;
    }
    for (unsigned i = 0; i < n; i++)
        dfd[i] = fd[i] = -1;
    /* Every swap file locked first, as an engine holds it (nvme.c): one in use is another
     * engine's, and nothing is removed. A process just killed keeps its lock until the
     * kernel has torn down its io_uring: waited for, up to three seconds, as nvme.c does. */
    for (unsigned i = 0; i < n && r == 0; i++) {
        snprintf(swap[i], sizeof(swap[i]), "%s.%u", NVME_SWAP_NAME, i);
        if ((dfd[i] = open_dir(dirs[i])) < 0) {
            r = dfd[i] == -ENOENT ? 0 : dfd[i];
            continue;
        }
        int k = saved_file(dfd[i], swap[i]);
        if (k == -ENOENT) continue;
        if (k < 0 ||
            (fd[i] = openat(dfd[i], swap[i], O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)) < 0) {
            r = k < 0 ? k : errno == ENOENT ? 0 : -errno;
            continue;
        }
        int locked = flock(fd[i], LOCK_EX | LOCK_NB);
        for (int tries = 0; locked != 0 && errno == EWOULDBLOCK && tries < 300; tries++) {
            usleep(10000);
            locked = flock(fd[i], LOCK_EX | LOCK_NB);
        }
        if (locked != 0) r = errno == EWOULDBLOCK ? -EBUSY : -errno;
    }
    /* The manifests, the previous version's first (as start_over does): once the current
     * one is gone the folder holds no saved state. Then the swap files, still locked. */
    static const char *const manifests[] = {MANIFEST_NAME PREV_SUFFIX, MANIFEST_NAME ".tmp",
                                            MANIFEST_NAME};
    for (size_t m = 0; m < ARRAY_SIZE(manifests) && r == 0 && dfd[0] >= 0; m++) {
        int k = saved_file(dfd[0], manifests[m]);
        if (k < 0 && k != -ENOENT) r = k;
    }
    for (size_t m = 0; m < ARRAY_SIZE(manifests) && r == 0 && dfd[0] >= 0; m++)
        if (unlinkat(dfd[0], manifests[m], 0) != 0 && errno != ENOENT) r = -errno;
    if (r == 0 && dfd[0] >= 0 && fsync(dfd[0]) != 0) r = -errno;
    for (unsigned i = 0; i < n && r == 0; i++)
        if (fd[i] >= 0 && unlinkat(dfd[i], swap[i], 0) != 0 && errno != ENOENT) r = -errno;
    for (unsigned i = 0; i < n; i++) {
        if (fd[i] >= 0) close(fd[i]);
        if (dfd[i] >= 0) close(dfd[i]);
    }
    return r;
}

/* The bytes of the file at path, NUL-terminated (*len without it), or NULL with *err:
 * -ELOOP for a link, -EINVAL for anything but a regular file (a FIFO is not waited on),
 * -errno. A manifest is only ever read through here: its folder may not be the engine's
 * alone. */
static char *read_regular(int dfd, const char *path, size_t *len, int *err)
{
    int fd = openat(dfd, rel(dfd, path), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    char *buf = NULL;
    *err = 0;
    if (fd < 0) {
        *err = -errno;
        return NULL;
    }
    if (fstat(fd, &st) != 0)
        *err = -errno;
    else if (!S_ISREG(st.st_mode))
        *err = -EINVAL;
    size_t cap = 0, n = 0;
    while (*err == 0) {
        if (cap - n < 2) {
            char *nb = realloc(buf, cap = cap ? 2 * cap : 64 * 1024);
            if (!nb) {
                *err = -ENOMEM;
                break;
            }
            buf = nb;
        }
        ssize_t got = read(fd, buf + n, cap - n - 1);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            *err = -errno;
        else if (got == 0)
            break;
        else
            n += (size_t)got;
    }
    close(fd);
    if (*err) {
        free(buf);
        return NULL;
    }
    if (!buf && !(buf = malloc(1))) {
        *err = -ENOMEM;
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

/* The manifest at path, parsed (NULL with *err: -EBADMSG for bad JSON, with jerr; or
 * read_regular's error). */
static json_t *load_manifest(int dfd, const char *path, size_t flags, json_error_t *jerr,
                             int *err)
{
    size_t n;
    char *buf = read_regular(dfd, path, &n, err);
    if (!buf)
        return NULL;
    json_t *root = json_loadb(buf, n, flags, jerr);
    free(buf);
    if (!root)
        *err = -EBADMSG;
    return root;
}

/* The tag of the manifest at path, -1 where it has none; -errno where it cannot be read. */
static int manifest_tag(int dfd, const char *path, int64_t *tag)
{
    json_error_t jerr;
    int err;
    json_t *root = load_manifest(dfd, path, 0, &jerr, &err);
    *tag = -1;
    if (!root)
        return err;
    json_t *t = json_object_get(root, "tag");
    if (json_is_integer(t) && json_integer_value(t) >= 0)
        *tag = (int64_t)json_integer_value(t);
    json_decref(root);
    return 0;
}

int persist_versions(const char *dir, int64_t tags[2])
{
    char path[4096];
    struct stat st;
    tags[0] = tags[1] = -1;
    int dfd = open_dir(dir);
    if (dfd < 0)
        return dfd;
    int which = current_manifest(dfd, dir, path, sizeof(path), &st);
    int r = which < 0 ? which : manifest_tag(dfd, path, &tags[0]);
    if (r == 0 && which == 0) { /* (.prev alone is the current one) */
        snprintf(path, sizeof(path), "%s/%s%s", dir, MANIFEST_NAME, PREV_SUFFIX);
        if (manifest_tag(dfd, path, &tags[1]) < 0)
            tags[1] = -1; /* none, or unreadable: not a version to go back to */
    }
    close(dfd);
    return r;
}

int persist_probe(const char *dir, size_t *ntensors, uint32_t *id)
{
    char path[4096];
    struct stat st;
    json_t *root = NULL;

    int dfd = open_dir(dir);
    if (dfd < 0)
        return dfd;
    int which = current_manifest(dfd, dir, path, sizeof(path), &st);
    if (which < 0) {
        close(dfd);
        return which;
    }
    /* A manifest that cannot be read or parsed may still be someone's only record of
     * what the swap files hold: it counts as a saved state, of unknown size. */
    *ntensors = SIZE_MAX;
    if (id)
        *id = 0;
    /* Its identity is a checksum of its bytes: a manifest is replaced by rename, and a
     * new one may get the old one's inode number and (on a coarse clock) its mtime; two
     * manifests with the same bytes describe the same state. */
    size_t len;
    int err;
    char *buf = read_regular(dfd, path, &len, &err);
    close(dfd);
    if (buf) {
        if (id)
            *id = crc32c(0, buf, len) ^ (uint32_t)len;
        root = json_loadb(buf, len, 0, NULL);
        free(buf);
    }
    if (root && json_is_array(json_object_get(root, "tensors")))
        *ntensors = json_array_size(json_object_get(root, "tensors"));
    json_decref(root);
    return 0;
}

static const char *tier_name(enum zinf_tier t)
{
    return t == ZINF_TIER_DEVICE ? "device" : t == ZINF_TIER_HOST ? "host" : "nvme";
}

static int write_all(int fd, const char *buf, size_t n)
{
    while (n) {
        ssize_t w = write(fd, buf, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -errno;
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Write text as the manifest: temp file, fsync, rename over, fsync the directory.
 * *renamed says whether the new manifest took the old one's place: from then on a crash
 * may leave either of them, so even when the directory's fsync fails (the error is
 * returned) both must stay readable. */
static int sync_dir(struct zinf_engine *e)
{
    int dfd = engine_dir_fd(e);
    if (dfd != AT_FDCWD)
        return fsync(dfd) < 0 ? -errno : 0;
    dfd = open(e->nvme_dirs[0], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int r = dfd < 0 || fsync(dfd) < 0 ? -errno : 0;
    if (dfd >= 0)
        close(dfd);
    return r;
}

static int manifest_commit(struct zinf_engine *e, const char *text, bool keep, bool *renamed)
{
    char path[4096], tmp[4200], prev[4200];
    int fd, r, dfd = engine_dir_fd(e);

    *renamed = false;
    manifest_path(e, path, sizeof(path), "");
    manifest_path(e, tmp, sizeof(tmp), ".tmp");
    manifest_path(e, prev, sizeof(prev), PREV_SUFFIX);
    /* Made new: whatever lies at tmp (a link, say) is replaced, never followed. */
    if (unlinkat(dfd, rel(dfd, tmp), 0) < 0 && errno != ENOENT) {
        r = -errno;
        log_error("engine: %s: %s", tmp, strerror(-r));
        return r;
    }
    fd = openat(dfd, rel(dfd, tmp), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        r = -errno;
        log_error("engine: %s: %s", tmp, strerror(-r));
        return r;
    }
    r = write_all(fd, text, strlen(text));
    if (r == 0 && fsync(fd) < 0)
        r = -errno;
    close(fd);
    /* Keeping the previous version: the current manifest becomes .prev first (from here
     * until the next rename, .prev alone is the current one). */
    if (r == 0 && keep && renameat(dfd, rel(dfd, path), dfd, rel(dfd, prev)) < 0 && errno != ENOENT)
        r = -errno;
    if (r == 0 && renameat(dfd, rel(dfd, tmp), dfd, rel(dfd, path)) < 0)
        r = -errno;
    if (r < 0) {
        log_error("engine: writing the manifest %s failed: %s", path, strerror(-r));
        unlinkat(dfd, rel(dfd, tmp), 0);
        return r;
    }
    *renamed = true;
    r = sync_dir(e);
    if (r == 0 && e->fault_dir_fsync) {
        r = e->fault_dir_fsync;
        e->fault_dir_fsync = 0;
    }
    if (r < 0)
        log_error("engine: %s: the new manifest is in place but syncing its directory failed "
                  "(%s): a crash may bring back the previous one, whose data is kept until "
                  "a flush completes", path, strerror(-r));
    return r;
}

/* ---- flush ------------------------------------------------------------------------------ */

struct entry {
    zinf_tensor handle;
    uint64_t off, version;
    uint32_t crc;
    bool zero;
};

/* Checksum of what the swap extent holds, by reading it through the staging ring. */
static int swap_checksum(struct zinf_engine *e, struct tensor *t, uint64_t off, uint32_t *crc)
{
    struct xfer x = {.e = e, .t = t, .src = ZINF_TIER_NVME, .dst = DST_NONE, .src_off = off,
                     .len = t->alloc_bytes, .want_crc = true, .what = "checksum"};
    int r = xfer_run_sync(e, &x);
    if (r == 0)
        *crc = x.crc;
    return r;
}

/* The newest content of t in a memory tier to read for a flush: a valid copy that no caller
 * holds, else one that a caller does (-1: none in memory). A caller's pin may be written
 * through at any moment, and the DIRTY release that makes that a version waits for the
 * flush: bytes read from it could mix two versions under the older one's label. Idle leases
 * are closed before the pins are counted: a client could otherwise pin one with atomics while
 * the flush reads, and write through it. */
static int flush_source(struct zinf_engine *e, struct tensor *t)
{
    int held = -1;
    for (int i = ZINF_TIER_HOST; i >= ZINF_TIER_DEVICE; i--) {
        const struct copy *c = &t->c[i];
        if (c->state != COPY_READY || c->version != t->version) continue;
        if (!copy_pinned(e, t, i)) return i;
        held = i;
    }
    return held;
}

/* Would flushing t now read its newest content from a copy that a caller holds? Not where
 * a manifest or the swap extent already has that content. Lock held. */
static bool flush_reads_held(struct zinf_engine *e, struct tensor *t)
{
    if (t->zero || (t->persisted && t->persisted_version == t->version && !t->persisted_zero) ||
        (t->has_swap && t->swap_version == t->version))
        return false;
    int src = flush_source(e, t);
    return src >= 0 && t->c[src].pins; /* its idle leases closed: what is left is held */
}

/* Make t's swap extent hold its newest content, on an extent the manifest does not name.
 * Lock held; t held exclusively. */
static int flush_tensor(struct zinf_engine *e, struct tensor *t, struct entry *en)
{
    int r;

    en->handle = t->handle;
    en->version = t->version;
    if (t->zero) {
        en->zero = true;
        en->off = t->has_swap ? t->swap_off : 0;
        return 0;
    }
    if (t->persisted && t->persisted_version == t->version && !t->persisted_zero) {
        en->off = t->persisted_off; /* unchanged since the last manifest */
        en->crc = t->persisted_crc;
        return 0;
    }
    if (t->has_swap && t->swap_version == t->version) {
        if (!t->swap_crc_valid) {
            r = swap_checksum(e, t, t->swap_off, &t->swap_crc);
            if (r < 0)
                return r;
            t->swap_crc_valid = true;
        }
        en->off = t->swap_off;
        en->crc = t->swap_crc;
        return 0;
    }
    /* The newest content is in memory: write it out. */
    int src = flush_source(e, t);
    if (src < 0) {
        log_error("engine: tensor '%s' has no valid copy to flush", t->name);
        return -EIO;
    }
    bool in_place = t->has_swap && !engine_swap_named(t);
    uint64_t off = t->swap_off;
    if (!in_place && (r = engine_swap_alloc(e, t->alloc_bytes, &off)) < 0) /* t is ours */
        return r;
    struct xfer x = {.e = e, .t = t, .src = src, .dst = ZINF_TIER_NVME,
                     .src_off = t->c[src].off, .src_ptr = t->c[src].ptr, .dst_off = off,
                     .len = t->alloc_bytes, .version = t->version, .want_crc = true,
                     .what = "flush"};
    t->c[src].readers++;
    r = xfer_run_sync(e, &x);
    t->c[src].readers--;
    if (r < 0) {
        if (!in_place)
            nvme_free(e->nvme, off);
        log_error("engine: flushing tensor '%s' failed: %s", t->name, zinf_strerror(r));
        return r;
    }
    if (!in_place && t->has_swap && !engine_swap_named(t))
        nvme_free(e->nvme, t->swap_off);
    t->swap_off = off;
    t->has_swap = true;
    /* The version that was copied: a pinned copy may have been released DIRTY while the
     * lock was dropped, and the extent does not hold that newer content. */
    t->swap_version = x.version;
    t->swap_crc = x.crc;
    t->swap_crc_valid = true;
    en->off = off;
    en->crc = x.crc;
    return 0;
}

static char *manifest_text(struct zinf_engine *e, struct entry *ents, size_t n, int64_t tag)
{
    json_t *root = json_object(), *arr = json_array();
    char *text = NULL;

    if (!root || !arr)
        goto out;
    json_object_set_new(root, "format", json_string(MANIFEST_FORMAT));
    json_object_set_new(root, "version", json_integer(MANIFEST_VERSION));
    json_object_set_new(root, "block_size", json_integer((json_int_t)e->block_size));
    json_object_set_new(root, "dirs", json_integer(e->nvme_ndirs));
    if (tag >= 0)
        json_object_set_new(root, "tag", json_integer((json_int_t)tag));
    for (size_t i = 0; i < n; i++) {
        struct tensor *t = engine_tensor(e, ents[i].handle);
        json_t *o = json_object();
        if (!t || !o) {
            json_decref(o);
            continue;
        }
        json_t *name = json_string(t->name);
        if (name) {
            json_object_set_new(o, "name", name);
        } else { /* not UTF-8: keep the bytes as hex */
            size_t len = strlen(t->name);
            char *hex = malloc(len * 2 + 1);
            for (size_t k = 0; hex && k < len; k++)
                sprintf(hex + 2 * k, "%02x", (unsigned char)t->name[k]);
            json_object_set_new(o, "name_hex", json_string(hex ? hex : ""));
            free(hex);
        }
        json_object_set_new(o, "nbytes", json_integer((json_int_t)t->nbytes));
        json_object_set_new(o, "home", json_string(tier_name(t->home)));
        json_object_set_new(o, "zero", json_boolean(ents[i].zero));
        json_object_set_new(o, "offset", json_integer((json_int_t)ents[i].off));
        json_object_set_new(o, "crc32c", json_integer(ents[i].crc));
        json_array_append_new(arr, o);
    }
    json_object_set_new(root, "tensors", arr);
    arr = NULL;
    text = json_dumps(root, JSON_INDENT(1));
out:
    json_decref(arr);
    json_decref(root);
    return text;
}

struct resume_progress resume_progress;

/* No previous version any more: its manifest goes (durably), then its extents are free.
 * Lock held. */
static int drop_previous(struct zinf_engine *e)
{
    char prev[4200];
    if (!e->has_prev)
        return 0;
    manifest_path(e, prev, sizeof(prev), PREV_SUFFIX);
    int dfd = engine_dir_fd(e);
    int r = unlinkat(dfd, rel(dfd, prev), 0) == 0 || errno == ENOENT ? 0 : -errno;
    if (r == 0)
        r = sync_dir(e);
    if (r < 0) {
        log_error("engine: removing the previous version %s failed: %s; its extents stay "
                  "allocated", prev, strerror(-r));
        return r;
    }
    for (size_t i = 0; i < e->nretained; i++)
        nvme_free(e->nvme, e->retained[i]);
    e->nretained = 0;
    e->has_prev = false;
    return 0;
}

int persist_drop_previous(struct zinf_engine *e)
{
    return drop_previous(e);
}

/* The two versions' invariants (debug builds): without a previous version nothing is
 * retained; no tensor's swap extent, and no extent the committed manifest names, is a
 * retained one (a write there would reach the previous version's bytes); no extent is
 * retained twice. Lock held. */
static void check_versions(struct zinf_engine *e)
{
#ifndef NDEBUG
    if (!e->has_prev && e->nretained) {
        log_error("engine: internal state broken: %zu extents retained without a previous "
                  "version", e->nretained);
        abort();
    }
    for (size_t k = 0; k < e->nretained; k++) {
        uint64_t off = e->retained[k];
        for (size_t j = k + 1; j < e->nretained; j++)
            if (e->retained[j] == off) {
                log_error("engine: internal state broken: extent %llu retained twice",
                          (unsigned long long)off);
                abort();
            }
        for (uint32_t i = 0; i < e->ntensors; i++) {
            const struct tensor *t = e->tensors[i];
            if (t && ((t->has_swap && t->swap_off == off) ||
                      (engine_persisted_extent(t) && t->persisted_off == off))) {
                log_error("engine: internal state broken: tensor '%s' uses extent %llu of the "
                          "previous version", t->name, (unsigned long long)off);
                abort();
            }
        }
    }
#else
    (void)e;
#endif
}

int persist_flush(struct zinf_engine *e)
{
    return persist_flush_tagged(e, -1, false);
}

int persist_flush_tagged(struct zinf_engine *e, int64_t tag, bool keep)
{
    struct entry *ents = NULL;
    bool renamed = false;
    size_t n = 0;
    int r = 0;
    uint64_t span0 = trace_on() ? now_ns() : 0;

    while (e->flushing)
        engine_wait(e);
    e->flushing = true;

    /* Handles first: tensors registered while this runs are not part of it. */
    zinf_tensor *hs = calloc(e->ntensors + 1, sizeof(*hs));
    ents = calloc(e->ntensors + 1, sizeof(*ents));
    if (!hs || !ents) {
        r = -ENOMEM;
        goto out;
    }
    size_t nh = 0;
    e->st.flush_bytes_total = e->st.flush_bytes_done = 0;
    for (uint32_t i = 0; i < e->ntensors; i++)
        if (e->tensors[i]) {
            hs[nh++] = e->tensors[i]->handle;
            e->st.flush_bytes_total += e->tensors[i]->alloc_bytes;
        }

    /* A tensor whose newest content only a caller's pin holds is waited for, up to
     * FLUSH_HELD_WAIT_NS in all: a writer releases it (DIRTY) and the flush saves a whole
     * version. The flushing thread's own pins, or pins held for longer, are read as they
     * are once the time is up. */
    uint64_t held_until = now_ns() + FLUSH_HELD_WAIT_NS;
    for (size_t i = 0; i < nh; i++) {
        struct tensor *t = engine_tensor_lock(e, hs[i]);
        bool traced = false;
        while (t && flush_reads_held(e, t) && now_ns() < held_until) {
            if (!traced && trace_on())
                trace_instant("engine", "flush waits for a held copy", t->name, "pinned",
                              (int64_t)t->alloc_bytes);
            traced = true;
            engine_tensor_unlock(e, t); /* its DIRTY release waits for an exclusive owner */
            engine_wait_until(e, held_until);
            t = engine_tensor_lock(e, hs[i]);
        }
        if (!t)
            continue;
        r = flush_tensor(e, t, &ents[n]);
        e->st.flush_bytes_done += t->alloc_bytes;
        if (r == 0 && t->has_swap) {
            /* From here until the manifest is committed or abandoned, writes to t must not
             * land in the extent it names (the lock is dropped while it is written). */
            t->flush_named = true;
            t->flush_off = ents[n].off;
        }
        engine_tensor_unlock(e, t);
        if (r < 0)
            goto out;
        n++;
    }
    e->st.flush_bytes_done = e->st.flush_bytes_total; /* those unregistered meanwhile too */

    pthread_mutex_unlock(&e->lock);
    r = nvme_sync(e->nvme);
    pthread_mutex_lock(&e->lock);
    if (r < 0) {
        log_error("engine: syncing the swap files failed: %s", zinf_strerror(r));
        goto out;
    }
    /* Untagged, a flush that saves what the committed manifest saved keeps its tag. */
    if (tag < 0 && e->ndeferred == 0 && n == e->persisted_count) {
        bool same = true;
        for (size_t i = 0; i < n && same; i++) {
            struct tensor *t = engine_tensor(e, ents[i].handle);
            same = t && t->persisted && t->persisted_off == ents[i].off &&
                   t->persisted_crc == ents[i].crc && t->persisted_zero == ents[i].zero;
        }
        if (same)
            tag = e->tag;
    }
    char *text = manifest_text(e, ents, n, tag);
    if (!text) {
        r = -ENOMEM;
        goto out;
    }
    /* At most two versions: the one kept so far goes when this one takes its place. */
    bool had_prev = e->has_prev;
    pthread_mutex_unlock(&e->lock);
    r = manifest_commit(e, text, keep, &renamed);
    pthread_mutex_lock(&e->lock);
    free(text);
    if (r < 0 && !renamed)
        goto out;
    e->tag = tag;
    e->persisted_count = n;

    /* The new manifest is in place: what it names is now the persisted state. What the old
     * one named and this one does not is free once the new one is durable; when the
     * directory's fsync failed, the old manifest may come back after a crash, so those
     * extents wait (deferred) for a flush that completes. */
    bool durable = r == 0;
    /* Keeping the previous version: what the old manifest named and this one does not is
     * retained for it, as are the extents it named of tensors gone since. What the version
     * kept before named is free once this commit is durable (its manifest was replaced). */
    size_t old_retained = keep ? e->nretained : 0;
    for (size_t i = 0; i < n; i++) {
        struct tensor *t = engine_tensor(e, ents[i].handle);
        if (!t)
            continue;
        if (engine_persisted_extent(t) && t->persisted_off != ents[i].off &&
            !(t->has_swap && t->swap_off == t->persisted_off)) {
            if (keep)
                engine_keep_extent(&e->retained, &e->nretained, &e->capretained,
                                   t->persisted_off);
            else
                engine_free_swap(e, t->persisted_off, !durable);
        }
        t->persisted = true;
        t->persisted_off = ents[i].off;
        t->persisted_crc = ents[i].crc;
        t->persisted_zero = ents[i].zero;
        t->persisted_version = ents[i].version;
    }
    if (keep) {
        for (size_t i = 0; i < e->ndeferred; i++)
            engine_keep_extent(&e->retained, &e->nretained, &e->capretained,
                               e->deferred_free[i]);
        e->ndeferred = 0;
        e->has_prev = true;
    }
    if (!durable)
        goto out;
    if (keep && had_prev && old_retained) {
        for (size_t i = 0; i < old_retained; i++)
            nvme_free(e->nvme, e->retained[i]);
        memmove(e->retained, e->retained + old_retained,
                (e->nretained - old_retained) * sizeof(*e->retained));
        e->nretained -= old_retained;
    }
    for (size_t i = 0; i < e->ndeferred; i++)
        nvme_free(e->nvme, e->deferred_free[i]);
    e->ndeferred = 0;
    /* Without a previous version to keep, one kept before goes now. */
    if (!keep && e->has_prev && (r = drop_previous(e)) < 0)
        goto out;
    check_versions(e);
    e->st.flushes++;
out:
    for (size_t i = 0; ents && i < n; i++) {
        struct tensor *t = engine_tensor(e, ents[i].handle);
        if (!t || !t->flush_named)
            continue;
        t->flush_named = false;
        /* Abandoned: an extent only this manifest named, and that writes moved away from
         * meanwhile, belongs to nobody now. (Once the manifest was renamed into place it
         * is not abandoned: it is the persisted state, durable or not.) */
        if (r < 0 && !renamed && t->flush_off != t->swap_off &&
            !(engine_persisted_extent(t) && t->persisted_off == t->flush_off))
            nvme_free(e->nvme, t->flush_off);
    }
    free(hs);
    free(ents);
    e->flushing = false;
    pthread_cond_broadcast(&e->changed);
    if (span0 && trace_on()) {
        trace_span("engine", "flush", span0, NULL, r < 0 ? "failed" : NULL, -1);
        engine_trace_counters(e, true); /* the values zinf_stats gives now */
    }
    return r;
}

/* ---- resume ------------------------------------------------------------------------------ */

static int parse_home(const char *s, enum zinf_tier *out)
{
    if (!strcmp(s, "device"))
        *out = ZINF_TIER_DEVICE;
    else if (!strcmp(s, "host"))
        *out = ZINF_TIER_HOST;
    else if (!strcmp(s, "nvme"))
        *out = ZINF_TIER_NVME;
    else
        return -EINVAL;
    return 0;
}

static char *entry_name(json_t *o)
{
    const char *s = json_string_value(json_object_get(o, "name"));
    if (s)
        return strdup(s);
    const char *hex = json_string_value(json_object_get(o, "name_hex"));
    if (!hex || strlen(hex) % 2)
        return NULL;
    size_t n = strlen(hex) / 2;
    char *out = malloc(n + 1);
    for (size_t i = 0; out && i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) {
            free(out);
            return NULL;
        }
        out[i] = (char)v;
    }
    if (out)
        out[n] = '\0';
    return out;
}

/* Bring one persisted tensor back: reserve its extent, load a home copy in memory, check
 * the checksum. Lock held. */
static int resume_tensor(struct zinf_engine *e, const char *mpath, size_t idx, json_t *o)
{
    json_t *jn = json_object_get(o, "nbytes"), *jo = json_object_get(o, "offset"),
           *jc = json_object_get(o, "crc32c"), *jz = json_object_get(o, "zero");
    const char *home_s = json_string_value(json_object_get(o, "home"));
    struct tensor *t = calloc(1, sizeof(*t));
    enum zinf_tier home;
    int r;

    if (!t)
        return -ENOMEM;
    t->name = entry_name(o);
    if (!t->name || !json_is_integer(jn) || json_integer_value(jn) <= 0 || !json_is_integer(jo) ||
        json_integer_value(jo) < 0 || !json_is_integer(jc) || !home_s ||
        parse_home(home_s, &home) < 0 || !json_is_boolean(jz)) {
        log_error("engine: %s: tensors[%zu]: malformed entry", mpath, idx);
        r = -EBADMSG;
        goto err;
    }
    t->nbytes = (size_t)json_integer_value(jn);
    t->alloc_bytes = align_up(t->nbytes, ZINF_ALIGN);
    t->home = home;
    t->version = 1;
    t->zero = json_is_true(jz);
    uint64_t off = (uint64_t)json_integer_value(jo);
    uint32_t want = (uint32_t)json_integer_value(jc);
    if (!t->zero || home == ZINF_TIER_NVME) {
        r = nvme_reserve(e->nvme, off, t->alloc_bytes);
        if (r < 0) {
            log_error("engine: %s: tensor '%s': its extent at %llu (%zu bytes) is not in the swap "
                      "files or overlaps another (%s)", mpath, t->name, (unsigned long long)off,
                      t->alloc_bytes, zinf_strerror(r));
            r = -EBADMSG;
            goto err;
        }
        t->has_swap = true;
        t->swap_off = off;
        t->swap_version = t->version;
    }
    /* Every tensor the manifest names is saved, a zero one of a memory home too (without
     * an extent: engine_persisted_extent), so that a flush of the state resumed is the
     * same state and keeps the manifest's tag. */
    t->persisted = true;
    t->persisted_off = t->has_swap ? off : 0; /* as flush_tensor names a zero one */
    t->persisted_version = t->version;
    t->persisted_zero = t->zero;
    t->persisted_crc = want;
    if (home != ZINF_TIER_NVME) {
        struct copy *c = &t->c[home];
        if (t->alloc_bytes > e->st.tier[home].capacity_bytes ||
            (r = tier_alloc(e, home, t->alloc_bytes, &c->off, &c->ptr)) < 0) {
            log_error("engine: %s: tensor '%s' (%zu bytes) no longer fits its home tier (%s)",
                      mpath, t->name, t->nbytes, tier_name(home));
            r = -ENOSPC;
            goto err_swap;
        }
        c->t = t;
        c->state = COPY_READY;
        c->version = t->version;
    }
    r = engine_add_tensor(e, t);
    if (r == -EEXIST) {
        log_error("engine: %s: tensors[%zu]: the name '%s' is there twice", mpath, idx, t->name);
        r = -EBADMSG;
    }
    if (r < 0)
        goto err_home;

    /* Load and verify. */
    uint32_t got = 0;
    if (t->zero) {
        if (home == ZINF_TIER_DEVICE)
            r = device_zero(e->dev, t->c[home].off, t->alloc_bytes);
        else if (home == ZINF_TIER_HOST)
            memset(t->c[home].ptr, 0, t->alloc_bytes);
        got = want;
    } else {
        /* Into host memory the read is direct and the checksum is taken there after it;
         * the other reads go through the staging ring, which checksums each chunk. */
        struct xfer x = {.e = e, .t = t, .src = ZINF_TIER_NVME, .src_off = off,
                         .len = t->alloc_bytes, .version = t->version,
                         .want_crc = home != ZINF_TIER_HOST, .what = "resume"};
        x.dst = home == ZINF_TIER_NVME ? DST_NONE : (int)home;
        if (home != ZINF_TIER_NVME) {
            x.dst_off = t->c[home].off;
            x.dst_ptr = t->c[home].ptr;
        }
        r = xfer_run_sync(e, &x);
        got = home == ZINF_TIER_HOST && r == 0 ? crc32c(0, t->c[home].ptr, t->alloc_bytes) : x.crc;
    }
    /* One tensor that cannot be brought back must not take the others with it: it stays
     * registered as damaged (fetch and read answer -EBADMSG), and its manifest entry and
     * extent are kept as they are, so that nothing on disk is lost. */
    if (r < 0) {
        log_error("engine: %s: reading tensor '%s' failed: %s; it is marked damaged, the other "
                  "tensors are resumed", mpath, t->name, zinf_strerror(r));
        t->damaged = true;
        e->st.tensors_damaged++;
        return 0;
    }
    if (got != want) {
        log_error("engine: tensor '%s': checksum mismatch in the swap files under %s (manifest "
                  "crc32c %08x, data %08x): corrupted or torn, not loaded; it is marked damaged, "
                  "the other tensors are resumed", t->name, e->nvme_dirs[0], want, got);
        t->damaged = true;
        e->st.tensors_damaged++;
        return 0;
    }
    t->swap_crc = want;
    t->swap_crc_valid = true;
    return 0;
err_home:
    if (home != ZINF_TIER_NVME)
        tier_free(e, home, t->c[home].off);
err_swap:
    if (t->has_swap)
        nvme_free(e->nvme, off);
err:
    free(t->name);
    free(t);
    return r;
}

/* Before a resume: which manifest it reads, into path. Rolling back (ENGINE_OPEN_PREVIOUS)
 * the previous version takes the current one's place; otherwise the previous version is
 * forgotten (its extents are not reserved, so they are free), and a .prev left alone by a
 * crash is the current one. Read-only, nothing moves: the path is the one to read. */
static int choose_manifest(struct zinf_engine *e, char *path, size_t len)
{
    char cur[4096], prev[4200];
    bool ro = (e->opt.flags & ZINF_OPEN_READONLY) != 0;
    manifest_path(e, cur, sizeof(cur), "");
    manifest_path(e, prev, sizeof(prev), PREV_SUFFIX);
    int dfd = engine_dir_fd(e);
    struct stat st;
    bool have_cur = fstatat(dfd, rel(dfd, cur), &st, AT_SYMLINK_NOFOLLOW) == 0,
         have_prev = fstatat(dfd, rel(dfd, prev), &st, AT_SYMLINK_NOFOLLOW) == 0;
    if (e->opt.flags & ENGINE_OPEN_PREVIOUS) {
        if (!have_prev && !have_cur) {
            log_error("engine: %s: no previous version to go back to", e->nvme_dirs[0]);
            return -ENOENT;
        }
        if (!have_prev) { /* .prev alone was current: already in place */
            snprintf(path, len, "%s", cur);
            return 0;
        }
        snprintf(path, len, "%s", ro ? prev : cur);
        if (ro)
            return 0;
        if (renameat(dfd, rel(dfd, prev), dfd, rel(dfd, cur)) < 0 || sync_dir(e) < 0) {
            int r = -errno;
            log_error("engine: going back to the previous version %s failed: %s", prev,
                      strerror(-r));
            return r;
        }
        log_notice("engine: %s: went back to the previous version", e->nvme_dirs[0]);
        return 0;
    }
    if (!have_cur && have_prev) {
        snprintf(path, len, "%s", ro ? prev : cur);
        if (!ro && (renameat(dfd, rel(dfd, prev), dfd, rel(dfd, cur)) < 0 || sync_dir(e) < 0))
            return -errno;
        return 0;
    }
    snprintf(path, len, "%s", cur);
    if (have_prev && !ro && (unlinkat(dfd, rel(dfd, prev), 0) < 0 || sync_dir(e) < 0))
        return -errno;
    return 0;
}

int persist_resume(struct zinf_engine *e)
{
    char path[4200];
    json_error_t jerr;
    json_t *root, *arr;
    int r = 0;

    if ((r = choose_manifest(e, path, sizeof(path))) < 0)
        return r;
    int err;
    root = load_manifest(engine_dir_fd(e), path, JSON_REJECT_DUPLICATES, &jerr, &err);
    if (!root && err == -ENOENT) {
        log_notice("engine: %s: no manifest: nothing to resume", path);
        return 0;
    }
    if (!root) {
        if (err == -EBADMSG)
            log_error("engine: %s:%d:%d: %s", path, jerr.line, jerr.column, jerr.text);
        else
            log_error("engine: %s: %s", path,
                      err == -EINVAL  ? "not a regular file: refused"
                      : err == -ELOOP ? "a symbolic link: refused"
                                      : strerror(-err));
        return err;
    }
    arr = json_object_get(root, "tensors");
    const char *fmt = json_string_value(json_object_get(root, "format"));
    json_int_t ver = json_integer_value(json_object_get(root, "version"));
    json_int_t bs = json_integer_value(json_object_get(root, "block_size"));
    json_int_t nd = json_integer_value(json_object_get(root, "dirs"));
    if (!fmt || strcmp(fmt, MANIFEST_FORMAT) || ver != MANIFEST_VERSION || !json_is_array(arr)) {
        log_error("engine: %s: not a zinf manifest of version %d", path, MANIFEST_VERSION);
        r = -EBADMSG;
        goto out;
    }
    if ((size_t)bs != e->block_size || (unsigned)nd != e->nvme_ndirs) {
        log_error("engine: %s: written with block_size %lld over %lld directories; now %zu over "
                  "%u: the striping differs, open with the same settings", path, (long long)bs,
                  (long long)nd, e->block_size, e->nvme_ndirs);
        r = -EINVAL;
        goto out;
    }
    json_t *jt = json_object_get(root, "tag");
    e->tag = json_is_integer(jt) && json_integer_value(jt) >= 0 ? (int64_t)json_integer_value(jt)
                                                                 : -1;
    e->persisted_count = json_array_size(arr);
    uint64_t total = 0, done = 0;
    for (size_t i = 0; i < json_array_size(arr); i++)
        total += (uint64_t)json_integer_value(json_object_get(json_array_get(arr, i), "nbytes"));
    atomic_store(&resume_progress.done, 0);
    atomic_store(&resume_progress.total, total);
    pthread_mutex_lock(&e->lock);
    for (size_t i = 0; i < json_array_size(arr) && r == 0; i++) {
        json_t *o = json_array_get(arr, i);
        r = resume_tensor(e, path, i, o);
        done += (uint64_t)json_integer_value(json_object_get(o, "nbytes"));
        atomic_store(&resume_progress.done, done);
    }
    pthread_mutex_unlock(&e->lock);
out:
    json_decref(root);
    return r;
}

/* ---- the saved state as zinf.h shows it (no engine opened) ------------------------------- */

ZINF_API int zinf_saved_steps(const char *dir, int64_t steps[2])
{
    if (!dir || !steps) return -EINVAL;
    return persist_versions(dir, steps);
}

ZINF_API int zinf_saved_at(const char *dir, int64_t *ns)
{
    struct timespec when;
    if (!dir || !ns) return -EINVAL;
    int r = persist_saved_at(dir, &when);
    if (r == 0) *ns = (int64_t)when.tv_sec * 1000000000 + when.tv_nsec;
    return r;
}

ZINF_API int zinf_saved_tensors(const char *dir, size_t *ntensors)
{
    if (!dir || !ntensors) return -EINVAL;
    return persist_probe(dir, ntensors, NULL);
}
