/*
 * nvme.c - the NVMe swap space behind nvme.h: swap files striped into one logical space,
 * extents from the extent allocator, IO through the IO engine.
 *
 * A striped request is handed to the engine whole, with stripe_map() as its map: the
 * engine cuts it at stripe boundaries itself, so one request keeps every drive busy
 * without this layer tracking sub-requests. The map reads only what nvme_open() fixed
 * (files, slots, stripe unit), so it needs no lock, which matters because the engine
 * calls it under its own.
 *
 * Not here: a manifest (after a keep open the caller reserves what it recorded), caching,
 * or any knowledge of what an extent holds.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "common.h"
#include "tiers/extent.h"
#include "tiers/nvme.h"


struct nvme_file {
    char *dir;
    char *path;   /* dir/name, for messages */
    char *name;   /* in dir */
    int dfd;      /* dir, opened once: the file is reached with *at(), never through a link */
    int slot;     /* the IO engine's file slot, -1 when not open */
    bool owned;   /* we hold its lock: it is ours to truncate, cut back and unlink */
    bool scratch; /* owned, and holds nothing of the user's: a failed open removes it */
};

struct nvme {
    struct uring *io;
    unsigned nfiles;
    uint64_t stripe_bytes;
    bool growable;
    bool remove_on_close;
    bool readonly;    /* opened with opts->readonly: no lock, no write, no growth */
    bool failed_open; /* nvme_close() from nvme_open()'s error path: remove our files */
    uint64_t max_bytes;

    pthread_mutex_t lock; /* guards everything below */
    bool lock_ready;
    pthread_cond_t grown; /* broadcast when a growth ends */
    bool growing;         /* one growth at a time; it runs with the lock dropped */
    struct extent_alloc ext;
    uint64_t file_bytes; /* every file has this size */
    uint64_t grows;
    unsigned fault_nth; /* nvme_fault_fallocate() */
    int fault_err;
    bool fallocate_missing_noted;

    struct nvme_file files[NVME_MAX_DIRS];
};

static const char *size_str(uint64_t bytes, char *buf, size_t len)
{
    return format_size(bytes, buf, len);
}

/* Extend (or preallocate) one file to [from, from + bytes). Returns 0 or -errno. */
static int file_extend(struct nvme *n, struct nvme_file *f, uint64_t from, uint64_t bytes)
{
    int fd = uring_file_fd(n->io, f->slot);

    if (fd < 0) return fd;
    if (n->fault_nth && --n->fault_nth == 0) return -n->fault_err;
    if (fallocate(fd, 0, (off_t)from, (off_t)bytes) == 0) return 0;
    if (errno != EOPNOTSUPP) return -errno;
    /* A filesystem without fallocate: extend sparsely. Space is then not reserved, and a
     * full disk shows up later as a write error instead of here. */
    if (!n->fallocate_missing_noted) {
        n->fallocate_missing_noted = true;
        log_notice("nvme: %s: no fallocate on this filesystem; swap space is not reserved "
                   "ahead",
                   f->dir);
    }
    return ftruncate(fd, (off_t)(from + bytes)) == 0 ? 0 : -errno;
}

/* Cut a file back to bytes after a failed growth step. */
static void file_cut(struct nvme *n, struct nvme_file *f, uint64_t bytes)
{
    int fd = uring_file_fd(n->io, f->slot);
    if (fd >= 0 && ftruncate(fd, (off_t)bytes) != 0)
        log_warn("nvme: %s: could not cut back to %llu bytes after a failed growth: %s", f->path,
                 (unsigned long long)bytes, strerror(errno));
}

static bool is_no_space(int err)
{
    return err == -ENOSPC || err == -EFBIG || err == -EDQUOT;
}

/* "dirA, dirB" for a log line. */
static const char *dir_list(const struct nvme *n, char *buf, size_t len)
{
    size_t used = 0;
    buf[0] = '\0';
    for (unsigned i = 0; i < n->nfiles && used < len; i++) {
        bool seen = false;
        for (unsigned j = 0; j < i; j++)
            seen |= strcmp(n->files[j].dir, n->files[i].dir) == 0;
        if (!seen)
            used +=
                (size_t)snprintf(buf + used, len - used, "%s%s", used ? ", " : "", n->files[i].dir);
    }
    return buf;
}

static int name_file(struct nvme_file *f, unsigned i, const char *dir)
{
    f->dir = strdup(dir);
    if (!f->dir || asprintf(&f->path, "%s/%s.%u", dir, NVME_SWAP_NAME, i) < 0) {
        f->path = NULL;
        return -ENOMEM;
    }
    f->name = strrchr(f->path, '/') + 1;
    /* The folder itself may be reached through a link its user configured. */
    f->dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (f->dfd < 0) {
        int r = -errno;
        log_error("nvme: %s: cannot open the swap directory: %s", dir, strerror(-r));
        return r;
    }
    return 0;
}

/* With keep: whether to reopen the swap files (every one exists) or to create them (none
 * does). Any other mix is -ENOENT, decided before anything is opened. A path that cannot
 * be examined for another reason counts as present, so that opening it says why. */
static int find_kept(const struct nvme *n, bool *reopen)
{
    const struct nvme_file *gone = NULL;
    unsigned present = 0;
    struct stat st;

    for (unsigned i = 0; i < n->nfiles; i++) {
        if (fstatat(n->files[i].dfd, n->files[i].name, &st, AT_SYMLINK_NOFOLLOW) == 0 ||
            errno != ENOENT)
            present++;
        else if (!gone)
            gone = &n->files[i];
    }
    *reopen = present == n->nfiles;
    if (*reopen || (present == 0 && !n->readonly)) return 0;
    if (present == 0)
        log_error("nvme: %s: cannot open the swap space read-only: %s does not exist", gone->dir,
                  gone->path);
    else
        log_error("nvme: %s: cannot reopen the swap space: %s is missing while %u of its %u "
                  "swap files exist",
                  gone->dir, gone->path, present, n->nfiles);
    return -ENOENT;
}

/* Open and lock file i (nvme_open() truncates it after, without keep). With reopen the
 * file must exist. */
static int open_file(struct nvme *n, unsigned i, bool keep, bool reopen)
{
    struct nvme_file *f = &n->files[i];
    const char *dir = f->dir;
    struct stat st;
    int fd, r;

    /* Never through a link, and never waiting on a FIFO put in the file's place: O_NONBLOCK
     * until it is known to be a regular file (io_uring would pass it on to every request). */
    f->slot = uring_file_openat(n->io, f->dfd, f->name,
                              (n->readonly ? O_RDONLY : O_RDWR | (reopen ? 0 : O_CREAT)) |
                                  O_NOFOLLOW | O_NONBLOCK,
                              0600);
    if (f->slot < 0) {
        r = f->slot;
        f->slot = -1;
        log_error("nvme: %s: cannot open swap file %s: %s", dir, f->path, strerror(-r));
        return r;
    }
    fd = uring_file_fd(n->io, f->slot);
    if (fd < 0) return fd;
    if (fstat(fd, &st) != 0) return -errno;
    if (!S_ISREG(st.st_mode)) {
        log_error("nvme: %s: %s is not a regular file", dir, f->path);
        return -EINVAL;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) return -errno;
    /* A reader takes no lock: it must work next to the process that holds the files, and
     * it neither writes nor truncates, so it cannot disturb that process. */
    if (n->readonly) return 0;
    /* The lock keeps a second swap space (this process or another) off the file; it is
     * released when the engine closes the fd. */
    /* A process that held the file and was just killed keeps it (and the lock) until the
     * kernel has torn down its io_uring: reopening after a crash, to resume or to start
     * over, waits up to three seconds (a loaded machine takes more than one). */
    int locked = flock(fd, LOCK_EX | LOCK_NB);
    for (int tries = 0; locked != 0 && errno == EWOULDBLOCK && tries < 300; tries++) {
        usleep(10000);
        locked = flock(fd, LOCK_EX | LOCK_NB);
    }
    if (locked != 0) {
        if (errno != EWOULDBLOCK) {
            r = -errno;
            log_error("nvme: %s: cannot lock %s: %s", dir, f->path, strerror(-r));
            return r;
        }
        log_error("nvme: %s: swap file %s is in use by another swap space", dir, f->path);
        return -EBUSY;
    }
    f->owned = true;
    /* A kept file is the user's; one that keep found absent a moment ago and created is
     * empty, unless another process wrote to it in between. */
    f->scratch = !keep || (!reopen && st.st_size == 0);
    return 0;
}

/* Without keep, once every file is locked: delete what names the old content, then empty
 * the files. */
static int start_over(struct nvme *n, const char *remove_first)
{
    if (remove_first) {
        /* Until the manifest is gone the files are the user's: a failure here keeps them. */
        for (unsigned i = 0; i < n->nfiles; i++)
            n->files[i].scratch = false;
        /* A previous version (engine/persist.c) first: the current one still says what
         * the files hold until it goes too. */
        /* remove_first lies in the first directory: removed there, by name. */
        const char *base = strrchr(remove_first, '/');
        base = base ? base + 1 : remove_first;
        int dfd = n->files[0].dfd;
        char prev[4200];
        snprintf(prev, sizeof(prev), "%s.prev", base);
        bool gone = unlinkat(dfd, prev, 0) == 0;
        if (!gone && errno != ENOENT) {
            int r = -errno;
            log_error("nvme: cannot remove %s.prev: %s; the swap files are left as they were",
                      remove_first, strerror(-r));
            return r;
        }
        if (unlinkat(dfd, base, 0) == 0 || (gone && errno == ENOENT)) {
            if (fsync(dfd) < 0) {
                int r = -errno;
                log_error("nvme: %s: syncing the directory after removing %s failed: %s; the "
                          "swap files are left as they were",
                          n->files[0].dir, remove_first, strerror(-r));
                return r;
            }
        } else if (errno != ENOENT) {
            int r = -errno;
            log_error("nvme: cannot remove %s: %s; the swap files are left as they were",
                      remove_first, strerror(-r));
            return r;
        }
        for (unsigned i = 0; i < n->nfiles; i++)
            n->files[i].scratch = true;
    }
    for (unsigned i = 0; i < n->nfiles; i++) {
        struct nvme_file *f = &n->files[i];
        if (ftruncate(uring_file_fd(n->io, f->slot), 0) != 0) {
            int r = -errno;
            log_error("nvme: %s: cannot truncate %s: %s", f->dir, f->path, strerror(-r));
            return r;
        }
    }
    return 0;
}

/* After a keep reopen: the files' sizes, taken down to the largest whole number of stripes
 * all of them hold; the logical space within bounds. Sets file_bytes.
 *
 * nvme_open() and growth only ever make whole stripes, and all files grow together; but a
 * growth whose fallocate ran out of space may have extended a file before failing (ext4
 * does), and a crash before it was cut back leaves the odd size, on one file or some. What
 * lies past the last whole stripe all files hold was never handed out, so it is cut off
 * (read-only: only not used), and the saved state is resumed; the manifest's extents are
 * checked against what is left. */
static int kept_size(struct nvme *n)
{
    uint64_t bytes[NVME_MAX_DIRS] = {0}, whole = UINT64_MAX;
    struct stat st;

    for (unsigned i = 0; i < n->nfiles; i++) {
        int fd = uring_file_fd(n->io, n->files[i].slot);
        if (fd < 0) return fd;
        if (fstat(fd, &st) != 0) return -errno;
        bytes[i] = (uint64_t)st.st_size;
        uint64_t w = bytes[i] - bytes[i] % n->stripe_bytes;
        if (w < whole) whole = w;
    }
    for (unsigned i = 0; i < n->nfiles; i++) {
        if (bytes[i] == whole) continue;
        struct nvme_file *f = &n->files[i];
        if (!n->readonly && ftruncate(uring_file_fd(n->io, f->slot), (off_t)whole) != 0) {
            int r = -errno;
            log_error("nvme: %s: cannot cut %s back from %llu to %llu bytes: %s", f->dir,
                      f->path, (unsigned long long)bytes[i], (unsigned long long)whole,
                      strerror(-r));
            return r;
        }
        log_notice("nvme: %s: %s has %llu bytes, past the %llu of whole stripes every swap "
                   "file holds (a growth cut short): %s", f->dir, f->path,
                   (unsigned long long)bytes[i], (unsigned long long)whole,
                   n->readonly ? "the rest is not read" : "cut back");
        bytes[i] = whole;
    }
    if (bytes[0] > NVME_MAX_BYTES / n->nfiles) {
        log_error("nvme: %s: cannot reopen the swap space: %s has %llu bytes, more than a "
                  "swap file may hold",
                  n->files[0].dir, n->files[0].path, (unsigned long long)bytes[0]);
        return -EINVAL;
    }
    n->file_bytes = bytes[0];
    return 0;
}

int nvme_open(const struct nvme_opts *o, struct uring *io, struct nvme **out)
{
    struct nvme *n;
    char a[32], b[32];
    bool reopen = false;
    int r;

    if (!o || !io || !out || !o->dirs || o->ndirs == 0 || o->ndirs > NVME_MAX_DIRS ||
        o->capacity_bytes > NVME_MAX_BYTES || o->max_bytes > NVME_MAX_BYTES)
        return -EINVAL;
    for (unsigned i = 0; i < o->ndirs; i++)
        if (!o->dirs[i] || !o->dirs[i][0]) return -EINVAL;
    uint64_t stripe = o->block_size ? o->block_size : uring_block_size(io);
    /* A power of two: the stripe arithmetic rounds with masks. */
    if (!stripe || !is_aligned(stripe, ZINF_ALIGN) || stripe > GiB || (stripe & (stripe - 1))) {
        log_error("nvme: the stripe unit (block size) must be a power of two from 4 KiB to "
                  "1 GiB, got %llu", (unsigned long long)stripe);
        return -EINVAL;
    }

    n = calloc(1, sizeof(*n));
    if (!n) return -ENOMEM;
    n->io = io;
    n->stripe_bytes = stripe;
    n->growable = o->capacity_bytes == 0;
    n->max_bytes = n->growable ? o->max_bytes : 0;
    n->remove_on_close = o->remove_on_close && !o->readonly;
    n->readonly = o->readonly;
    for (unsigned i = 0; i < NVME_MAX_DIRS; i++) {
        n->files[i].slot = -1;
        n->files[i].dfd = -1;
    }
    if (pthread_mutex_init(&n->lock, NULL) != 0) {
        r = -ENOMEM;
        goto err;
    }
    if (pthread_cond_init(&n->grown, NULL) != 0) {
        pthread_mutex_destroy(&n->lock);
        r = -ENOMEM;
        goto err;
    }
    n->lock_ready = true;

    for (unsigned i = 0; i < o->ndirs; i++) {
        n->nfiles = i + 1; /* so the error path sees this file too */
        r = name_file(&n->files[i], i, o->dirs[i]);
        if (r < 0) goto err;
    }
    if (o->keep || o->readonly) {
        r = find_kept(n, &reopen);
        if (r < 0) goto err;
    }
    for (unsigned i = 0; i < n->nfiles; i++) {
        r = open_file(n, i, o->keep || o->readonly, reopen);
        if (r < 0) goto err;
    }
    if (!o->keep && !o->readonly && (r = start_over(n, o->remove_before_truncate)) < 0)
        goto err;

    if (reopen) {
        r = kept_size(n);
        if (r < 0) goto err;
    } else if (!n->growable) {
        /* A fixed capacity is split evenly, each share rounded up to whole stripes. */
        n->file_bytes = align_up((o->capacity_bytes + n->nfiles - 1) / n->nfiles, n->stripe_bytes);
    }
    for (unsigned i = 0; i < n->nfiles && n->file_bytes && !reopen; i++) {
        r = file_extend(n, &n->files[i], 0, n->file_bytes);
        if (r < 0) {
            log_error("nvme: %s: no space for %s of swap (preallocating %s: %s)", n->files[i].dir,
                      size_str(n->file_bytes, a, sizeof(a)), n->files[i].path, strerror(-r));
            if (is_no_space(r)) r = -ENOSPC;
            goto err;
        }
    }
    /* Each new file's name made durable in its directory (the manifest's commit syncs only
     * the first one's): a crash must not lose a swap file a manifest names. */
    for (unsigned i = 0; i < n->nfiles && !reopen && !n->readonly; i++) {
        r = fsync(n->files[i].dfd) < 0 ? -errno : 0;
        if (r < 0) {
            log_error("nvme: %s: syncing the directory after making %s failed: %s",
                      n->files[i].dir, n->files[i].path, strerror(-r));
            goto err;
        }
    }
    r = extent_init(&n->ext, n->file_bytes * n->nfiles, ZINF_ALIGN);
    if (r < 0) goto err;

    log_debug("nvme: %u swap file(s)%s, stripe %s, capacity %s%s", n->nfiles,
              n->readonly ? " opened read-only"
              : reopen    ? " reopened"
                          : "",
              size_str(n->stripe_bytes, a, sizeof(a)),
              size_str(n->file_bytes * n->nfiles, b, sizeof(b)),
              n->growable ? " (grows on demand)" : "");
    *out = n;
    return 0;

err:
    n->failed_open = true;
    nvme_close(n);
    return r;
}

void nvme_close(struct nvme *n)
{
    if (!n) return;
    for (unsigned i = 0; i < n->nfiles; i++) {
        struct nvme_file *f = &n->files[i];
        /* Unlink while the lock is still held, so no other swap space has adopted the
         * file in between. A failed open removes only what holds nothing of the user's. */
        bool remove = n->failed_open ? f->scratch : n->remove_on_close;
        if (f->owned && remove && unlinkat(f->dfd, f->name, 0) != 0)
            log_warn("nvme: cannot remove %s: %s", f->path, strerror(errno));
        if (f->dfd >= 0) close(f->dfd);
        if (f->slot >= 0) uring_file_close(n->io, f->slot);
        free(f->path);
        free(f->dir);
    }
    extent_fini(&n->ext);
    if (n->lock_ready) {
        pthread_mutex_destroy(&n->lock);
        pthread_cond_destroy(&n->grown);
    }
    free(n);
}

/* Extend every file by step bytes; all or nothing: on failure the files that grew are
 * cut back and *bad names the one that failed. Called by the one growth in progress, with
 * the lock dropped: file_bytes changes only at the end of a growth, and no IO reaches
 * past it, so nothing else touches what this changes. */
static int extend_all(struct nvme *n, uint64_t step, unsigned *bad)
{
    for (unsigned i = 0; i < n->nfiles; i++) {
        int r = file_extend(n, &n->files[i], n->file_bytes, step);
        if (r < 0) {
            *bad = i;
            /* The file that failed may have been partly extended too. */
            file_cut(n, &n->files[i], n->file_bytes);
            while (i--)
                file_cut(n, &n->files[i], n->file_bytes);
            return r;
        }
    }
    return 0;
}

/* Grow every file so that an allocation of need bytes fits. Lock held. Returns 0 or
 * -errno, with state (and, as far as ftruncate allows, the files) unchanged on error. */
static int grow(struct nvme *n, uint64_t need)
{
    char a[32], b[32], c[32], e[32], d[256];
    struct extent_stats es;
    uint64_t step, min_step, new_bytes;
    int r;

    /* The new space joins a free tail, so only the part the tail lacks is missing. */
    extent_get_stats(&n->ext, &es);
    uint64_t missing = need - MIN(need, es.tail_free_bytes);
    min_step = align_up((missing + n->nfiles - 1) / n->nfiles, n->stripe_bytes);
    step = MAX(min_step, align_up(NVME_GROW_MIN_BYTES, n->stripe_bytes));
    if (n->max_bytes) {
        uint64_t cap = align_down(n->max_bytes / n->nfiles, n->stripe_bytes);
        step = n->file_bytes + step <= cap ? step : cap - MIN(cap, n->file_bytes);
        if (step < min_step) {
            log_error("nvme: %s: no space for %s of swap (capped at %s; %s in use, largest "
                      "free extent %s)",
                      dir_list(n, d, sizeof(d)), size_str(need, a, sizeof(a)),
                      size_str(n->max_bytes, b, sizeof(b)), size_str(es.used_bytes, c, sizeof(c)),
                      size_str(es.largest_free_bytes, e, sizeof(e)));
            return -ENOSPC;
        }
    }
    new_bytes = n->file_bytes + step;
    if (new_bytes > NVME_MAX_BYTES / n->nfiles) {
        log_error("nvme: %s: no space for %s of swap (files would pass %s each)",
                  dir_list(n, d, sizeof(d)), size_str(need, a, sizeof(a)),
                  size_str(NVME_MAX_BYTES / n->nfiles, b, sizeof(b)));
        return -ENOSPC;
    }

    unsigned bad;
    /* fallocate can take long (seconds on a slow drive): allocations from the space there
     * is, frees and IO go on meanwhile; a second growth waits for this one. */
    n->growing = true;
    pthread_mutex_unlock(&n->lock);
    r = extend_all(n, step, &bad);
    if (is_no_space(r) && step > min_step) {
        /* The usual step does not fit on the filesystem; what this allocation lacks may,
         * and a nearly full drive should still serve it. */
        step = min_step;
        new_bytes = n->file_bytes + step;
        r = extend_all(n, step, &bad);
    }
    pthread_mutex_lock(&n->lock);
    n->growing = false;
    pthread_cond_broadcast(&n->grown);
    if (r < 0) {
        struct nvme_file *f = &n->files[bad];
        struct statvfs vfs;
        char avail[48] = "unknown";
        if (statvfs(f->dir, &vfs) == 0)
            size_str((uint64_t)vfs.f_bavail * vfs.f_frsize, avail, sizeof(avail));
        if (is_no_space(r))
            log_error("nvme: %s: no space for %s (%llu bytes) more of swap: growing %s from %s "
                      "to %s for an allocation of %s failed (%s); %s free there. Free space "
                      "in %s or give a directory on a larger drive",
                      f->dir, size_str(step, a, sizeof(a)), (unsigned long long)step, f->path,
                      size_str(n->file_bytes, b, sizeof(b)), size_str(new_bytes, c, sizeof(c)),
                      size_str(need, e, sizeof(e)), strerror(-r), avail, f->dir);
        else
            log_error("nvme: %s: cannot add %s of swap (growing %s from %s to %s for an "
                      "allocation of %s: %s)",
                      f->dir, size_str(step, a, sizeof(a)), f->path,
                      size_str(n->file_bytes, b, sizeof(b)), size_str(new_bytes, c, sizeof(c)),
                      size_str(need, e, sizeof(e)), strerror(-r));
        return is_no_space(r) ? -ENOSPC : r;
    }
    r = extent_grow(&n->ext, new_bytes * n->nfiles);
    if (r < 0) {
        for (unsigned i = 0; i < n->nfiles; i++)
            file_cut(n, &n->files[i], n->file_bytes);
        return r;
    }
    n->file_bytes = new_bytes;
    n->grows++;
    return 0;
}

/* Allocate, growing the files when may_grow (then waiting for a growth in progress);
 * without it, -EAGAIN where only a growth would make room. Lock held. */
static int alloc_locked(struct nvme *n, uint64_t bytes, uint64_t *off, bool may_grow)
{
    char a[32], b[32], c[32], e[32], d[256];
    int r;

    for (;;) {
        r = extent_alloc(&n->ext, bytes, off);
        if (r != -ENOSPC || !n->growable)
            break;
        if (!may_grow)
            return -EAGAIN;
        if (n->growing) { /* the growth in progress may make room: look again after it */
            pthread_cond_wait(&n->grown, &n->lock);
            continue;
        }
        r = grow(n, align_up(bytes, ZINF_ALIGN));
        if (r < 0)
            return r;
    }
    if (r == -ENOSPC) {
        struct extent_stats es;
        extent_get_stats(&n->ext, &es);
        log_error("nvme: %s: no space for %s of swap (fixed capacity %s; %s in use, largest "
                  "free extent %s)",
                  dir_list(n, d, sizeof(d)), size_str(bytes, a, sizeof(a)),
                  size_str(es.capacity_bytes, b, sizeof(b)), size_str(es.used_bytes, c, sizeof(c)),
                  size_str(es.largest_free_bytes, e, sizeof(e)));
    }
    return r;
}

static int alloc_checked(struct nvme *n, uint64_t bytes, uint64_t *off, bool may_grow)
{
    if (!n || !off || !bytes || bytes > NVME_MAX_BYTES) return -EINVAL;
    if (n->readonly) return -EROFS;
    pthread_mutex_lock(&n->lock);
    int r = alloc_locked(n, bytes, off, may_grow);
    pthread_mutex_unlock(&n->lock);
    return r;
}

int nvme_alloc(struct nvme *n, uint64_t bytes, uint64_t *off)
{
    return alloc_checked(n, bytes, off, true);
}

int nvme_alloc_nogrow(struct nvme *n, uint64_t bytes, uint64_t *off)
{
    return alloc_checked(n, bytes, off, false);
}

int nvme_grow_for(struct nvme *n, uint64_t bytes)
{
    uint64_t off;
    if (!n || !bytes || bytes > NVME_MAX_BYTES) return -EINVAL;
    if (n->readonly) return -EROFS;
    pthread_mutex_lock(&n->lock);
    /* Allocate and give it back: the simplest proof that an allocation of bytes fits. */
    int r = alloc_locked(n, bytes, &off, true);
    if (r == 0)
        extent_free(&n->ext, off);
    pthread_mutex_unlock(&n->lock);
    return r;
}

int nvme_reserve(struct nvme *n, uint64_t off, uint64_t bytes)
{
    if (!n || !bytes || bytes > NVME_MAX_BYTES) return -EINVAL;
    pthread_mutex_lock(&n->lock);
    int r = extent_reserve(&n->ext, off, bytes);
    pthread_mutex_unlock(&n->lock);
    return r;
}

int nvme_free(struct nvme *n, uint64_t off)
{
    if (!n) return -EINVAL;
    pthread_mutex_lock(&n->lock);
    int r = extent_free(&n->ext, off);
    pthread_mutex_unlock(&n->lock);
    return r;
}

/* Logical offset -> (file slot, physical offset), contiguous to the end of the stripe. */
static int stripe_map(void *data, uint64_t off, int *file, uint64_t *phys, uint64_t *contig_bytes)
{
    const struct nvme *n = data;
    uint64_t stripe = off / n->stripe_bytes, within = off % n->stripe_bytes;

    *file = n->files[stripe % n->nfiles].slot;
    *phys = (stripe / n->nfiles) * n->stripe_bytes + within;
    *contig_bytes = n->stripe_bytes - within;
    return 0;
}

/* Alignment, and [off, off + len) inside one live allocation. */
static int check_io(struct nvme *n, uint64_t off, const void *buf, size_t len)
{
    uint64_t start, elen;
    int r;

    if (!n || !buf || !len || !is_aligned((uintptr_t)buf, ZINF_ALIGN) ||
        !is_aligned(len, ZINF_ALIGN) || !is_aligned(off, ZINF_ALIGN) || off + len < off)
        return -EINVAL;
    pthread_mutex_lock(&n->lock);
    r = extent_find(&n->ext, off, &start, &elen);
    pthread_mutex_unlock(&n->lock);
    if (r < 0 || off + len > start + elen) return -EINVAL;
    return 0;
}

int nvme_submit(struct nvme *n, struct uring_req *req)
{
    if (!req) return -EINVAL;
    int r = check_io(n, req->off, req->buf, req->len);
    if (r < 0) return r;
    if (n->readonly && req->op != URING_READ) return -EROFS;
    if (n->nfiles == 1) {
        req->file = n->files[0].slot;
        req->map = NULL;
        req->map_data = NULL;
    } else {
        req->file = -1;
        req->map = stripe_map;
        req->map_data = n;
    }
    return uring_submit(n->io, req);
}

static void sync_cb(struct uring_req *req, int res)
{
    completion_post(req->data, res);
}

static int sync_io(struct nvme *n, enum uring_op op, uint64_t off, void *buf, size_t len)
{
    struct completion w = COMPLETION_INIT;
    struct uring_req req = {
        .op = op, .buf = buf, .len = len, .off = off, .cb = sync_cb, .data = &w};
    int r = nvme_submit(n, &req);
    if (r < 0) return r;
    return completion_wait(&w);
}

int nvme_read(struct nvme *n, uint64_t off, void *buf, size_t len)
{
    return sync_io(n, URING_READ, off, buf, len);
}

int nvme_write(struct nvme *n, uint64_t off, const void *buf, size_t len)
{
    /* The engine only reads from buf for a write; its request type is not const. */
    return sync_io(n, URING_WRITE, off, (void *)buf, len);
}

int nvme_sync(struct nvme *n)
{
    int ret = 0;

    if (!n) return -EINVAL;
    if (n->readonly) return 0; /* nothing was written */
    for (unsigned i = 0; i < n->nfiles; i++) {
        int fd = uring_file_fd(n->io, n->files[i].slot);
        int r = fd < 0 ? fd : fdatasync(fd) == 0 ? 0 : -errno;
        if (r < 0 && ret == 0) {
            log_error("nvme: %s: fdatasync failed: %s", n->files[i].path, strerror(-r));
            ret = r;
        }
    }
    return ret;
}

void nvme_get_stats(struct nvme *n, struct nvme_stats *out)
{
    struct extent_stats es;

    *out = (struct nvme_stats){0};
    if (!n) return;
    pthread_mutex_lock(&n->lock);
    extent_get_stats(&n->ext, &es);
    out->capacity_bytes = es.capacity_bytes;
    out->used_bytes = es.used_bytes;
    out->free_bytes = es.free_bytes;
    out->largest_free_bytes = es.largest_free_bytes;
    out->used_extents = es.used_extents;
    out->free_extents = es.free_extents;
    out->file_bytes = n->file_bytes;
    out->grows = n->grows;
    pthread_mutex_unlock(&n->lock);
    out->block_size = n->stripe_bytes;
    out->files = n->nfiles;
    out->growable = n->growable;
    for (unsigned i = 0; i < n->nfiles; i++) {
        out->paths[i] = n->files[i].path;
        if (!uring_file_direct(n->io, n->files[i].slot)) out->buffered_files++;
    }
}

void nvme_fault_fallocate(struct nvme *n, unsigned nth, int err)
{
    if (!n) return;
    pthread_mutex_lock(&n->lock);
    n->fault_nth = err ? nth : 0;
    n->fault_err = err;
    pthread_mutex_unlock(&n->lock);
}

int nvme_dir_fd(struct nvme *n, unsigned i)
{
    return n && i < n->nfiles ? n->files[i].dfd : -EINVAL;
}
