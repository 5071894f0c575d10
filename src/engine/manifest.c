/*
 * manifest.c - the saved state on disk: where the manifest lives and which of a folder's
 * manifests is the current one (a crash between the two renames of a flush keeping the
 * previous version leaves .prev alone), reading one (never through a link, never from a
 * FIFO), committing a new one (temp file, fsync, rename, fsync of the folder), the crc32c it
 * records, and the calls of zinf.h that look at or remove a saved state without an engine
 * (zinf_saved_*).
 *
 * Not here: what a manifest says and when one is written (persist.c), or reading one back
 * into an engine (resume.c).
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
#include "engine/manifest.h"
#include "tiers/nvme.h"

#define MANIFEST_NAME "zinf-manifest.json"

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

void manifest_path(struct zinf_engine *e, char *buf, size_t len, const char *suffix)
{
    snprintf(buf, len, "%s/%s%s", e->nvme_dirs[0], MANIFEST_NAME, suffix);
}

/* Files in the manifest's folder are reached relative to it (openat, fstatat, renameat,
 * unlinkat with the file's name), never through a link in its place: the folder is opened
 * once, by the swap files' layer (an engine's) or here (a path given). dir_fd: that folder's
 * fd, or AT_FDCWD where there is none (then the whole path is used). */
int manifest_dir_fd(struct zinf_engine *e)
{
    int fd = nvme_dir_fd(e->nvme, 0);
    return fd >= 0 ? fd : AT_FDCWD;
}

const char *manifest_rel(int dir_fd, const char *path)
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
    int dfd = manifest_dir_fd(e);
    manifest_path(e, path, sizeof(path), PREV_SUFFIX);
    if (unlinkat(dfd, manifest_rel(dfd, path), 0) < 0 && errno != ENOENT)
        return -errno;
    manifest_path(e, path, sizeof(path), "");
    /* The swap files were just emptied: a manifest left from before names nothing now. */
    if (unlinkat(dfd, manifest_rel(dfd, path), 0) < 0 && errno != ENOENT)
        return -errno;
    return 0;
}

/* The manifest of dir that counts as the current one: zinf-manifest.json, or where a crash
 * came between the two renames of a flush keeping the previous version, the .prev one. */
static int current_manifest(int dfd, const char *dir, char *path, size_t len, struct stat *st)
{
    snprintf(path, len, "%s/%s", dir, MANIFEST_NAME);
    if (fstatat(dfd, manifest_rel(dfd, path), st, AT_SYMLINK_NOFOLLOW) == 0)
        return 0;
    int r = -errno;
    if (r != -ENOENT)
        return r;
    snprintf(path, len, "%s/%s%s", dir, MANIFEST_NAME, PREV_SUFFIX);
    return fstatat(dfd, manifest_rel(dfd, path), st, AT_SYMLINK_NOFOLLOW) == 0 ? 1 : -errno;
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
    int fd = openat(dfd, manifest_rel(dfd, path), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
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
json_t *manifest_load(int dfd, const char *path, size_t flags, json_error_t *jerr,
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
    json_t *root = manifest_load(dfd, path, 0, &jerr, &err);
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

const char *manifest_tier_name(enum zinf_tier t)
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

/* fsync the manifest's folder: a rename or an unlink there is durable once it returns 0. */
int manifest_sync_dir(struct zinf_engine *e)
{
    int dfd = manifest_dir_fd(e);
    if (dfd != AT_FDCWD)
        return fsync(dfd) < 0 ? -errno : 0;
    dfd = open(e->nvme_dirs[0], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int r = dfd < 0 || fsync(dfd) < 0 ? -errno : 0;
    if (dfd >= 0)
        close(dfd);
    return r;
}

/* Write text as the manifest: temp file, fsync, rename over, fsync the directory.
 * *renamed says whether the new manifest took the old one's place: from then on a crash
 * may leave either of them, so even when the directory's fsync fails (the error is
 * returned) both must stay readable. */
int manifest_commit(struct zinf_engine *e, const char *text, bool keep, bool *renamed)
{
    char path[4096], tmp[4200], prev[4200];
    int fd, r, dfd = manifest_dir_fd(e);

    *renamed = false;
    manifest_path(e, path, sizeof(path), "");
    manifest_path(e, tmp, sizeof(tmp), ".tmp");
    manifest_path(e, prev, sizeof(prev), PREV_SUFFIX);
    /* Made new: whatever lies at tmp (a link, say) is replaced, never followed. */
    if (unlinkat(dfd, manifest_rel(dfd, tmp), 0) < 0 && errno != ENOENT) {
        r = -errno;
        log_error("engine: %s: %s", tmp, strerror(-r));
        return r;
    }
    fd = openat(dfd, manifest_rel(dfd, tmp), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                0600);
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
    if (r == 0 && keep &&
        renameat(dfd, manifest_rel(dfd, path), dfd, manifest_rel(dfd, prev)) < 0 && errno != ENOENT)
        r = -errno;
    if (r == 0 && renameat(dfd, manifest_rel(dfd, tmp), dfd, manifest_rel(dfd, path)) < 0)
        r = -errno;
    if (r < 0) {
        log_error("engine: writing the manifest %s failed: %s", path, strerror(-r));
        unlinkat(dfd, manifest_rel(dfd, tmp), 0);
        return r;
    }
    *renamed = true;
    r = manifest_sync_dir(e);
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
