/*
 * nvme.h - the NVMe swap space: one swap file per directory (one directory per drive),
 * seen by callers as a single logical address space in which extents are allocated.
 *
 * Files. Directory i of opts->dirs holds "zinf-swap.<i>" (mode 0600). nvme_open() creates
 * it, or truncates an existing one (unless opts->keep: see Reopening), takes an exclusive
 * flock() on it so that a second swap space cannot use it at the same time, and
 * preallocates it with fallocate(). Files are opened through uring_file_open(), so with
 * O_DIRECT where the filesystem allows it and buffered where it refuses.
 *
 * Layout. The logical space is striped over the files in block_size units so that the
 * drives serve one large request in parallel: logical offset L lives in file
 * (L / block_size) % nfiles at offset (L / (block_size * nfiles)) * block_size +
 * L % block_size. With one directory the mapping is the identity. Every file has the same
 * size, so the logical capacity is nfiles times the file size.
 *
 * Capacity. A nonzero capacity_bytes is split over the files (rounded up to block_size
 * each) and preallocated; an allocation that does not fit fails with -ENOSPC. With
 * capacity_bytes 0 the files start empty and grow on demand: an allocation that does not
 * fit extends every file by the larger of what it needs and 256 MiB, up to max_bytes when
 * that is set; where the filesystem has no room for 256 MiB more, by just what it needs.
 * Growth is all or nothing: if any file cannot grow, those that did are cut back and the
 * capacity is unchanged. Every -ENOSPC is logged as one error line naming the directory
 * (or directories), the swap file, the bytes needed and, for a full filesystem, what is
 * free on it.
 *
 * Reopening. With opts->keep, existing swap files are opened as they are: nothing is
 * truncated or preallocated, the logical capacity is what the files hold (so a nonzero
 * capacity_bytes only says that the space does not grow), and nothing is allocated. The
 * caller, which recorded what it had written, nvme_reserve()s those extents at their
 * offsets and reads them back; everything else is free, and with capacity_bytes 0 the
 * space grows on demand as usual. The layout depends only on the directories, their order
 * and the stripe unit, so all three must be what they were. The files must all be there
 * with one size, a whole number of stripes: a missing file is -ENOENT and files of
 * different sizes (or of a size that no stripe unit of this one produced) are -EINVAL,
 * each logged with the file and the sizes. Where none of the files exists yet (a fresh
 * directory) keep creates them as a plain open does, so a first start and a restart can
 * use the same options. A failed keep open leaves existing files alone, whatever
 * remove_on_close says; it removes only the files it created.
 *
 * Read-only. With opts->readonly (which implies keep) the files are opened O_RDONLY and
 * not locked, so a reader works next to the swap space that holds them; every file must
 * exist (-ENOENT otherwise: nothing is created). Reads and nvme_reserve() work;
 * nvme_alloc() and writes return -EROFS, nvme_sync() has nothing to do, and no byte of
 * the files changes, remove_on_close notwithstanding.
 *
 * IO. Buffers, offsets and lengths are 4 KiB aligned (the O_DIRECT rule), and a transfer
 * must lie inside one live allocation: anything else is -EINVAL, before any IO.
 *
 * Thread safety: every function may be called from any thread; a mutex serialises
 * allocation and growth. IO does not take it beyond the bounds check.
 *
 * What it deliberately is not: persistent by itself (there is no manifest here: which
 * extents hold what is the engine's to record, and without keep files are truncated at
 * open), a cache (every read and write goes to the files), or a scheduler (queue depth
 * and chunking are the IO engine's).
 */
#ifndef ZINF_TIERS_NVME_H
#define ZINF_TIERS_NVME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "io/uring.h"

#define NVME_MAX_DIRS 16
/* The largest swap space (and so the largest NVMe-home tensor): keeps size arithmetic far
 * from overflow. */
#define NVME_MAX_BYTES ((uint64_t)1 << 60)
#define NVME_SWAP_NAME "zinf-swap"                /* file i is DIR/zinf-swap.<i> */
#define NVME_GROW_MIN_BYTES ((uint64_t)256 << 20) /* per file, per growth step */

struct nvme;

struct nvme_opts {
    const char *const *dirs; /* 1..NVME_MAX_DIRS directories, one per drive; may repeat */
    unsigned ndirs;
    uint64_t capacity_bytes; /* fixed, preallocated capacity; 0: grow on demand */
    uint64_t max_bytes;      /* with capacity_bytes 0: growth cap; 0: until a disk is full */
    size_t block_size;       /* stripe unit, multiple of 4 KiB; 0: uring_block_size(io) */
    bool remove_on_close;    /* unlink the swap files at nvme_close() */
    bool keep;               /* reopen existing swap files with their content (see above) */
    bool readonly;           /* open existing files read-only, unlocked (see above) */
    /* Without keep: a file to delete (durably: its directory is fsynced) once every swap
     * file is locked and before any is truncated, such as the manifest that names their
     * old content; NULL: none. A crash in between then leaves no manifest naming bytes
     * that are gone. */
    const char *remove_before_truncate;
};

struct nvme_stats {
    uint64_t capacity_bytes; /* logical: file_bytes * files */
    uint64_t used_bytes, free_bytes;
    uint64_t largest_free_bytes; /* the largest allocation that fits without growing */
    uint64_t file_bytes;         /* size of each swap file */
    uint64_t block_size;         /* stripe unit */
    uint64_t used_extents, free_extents;
    uint64_t grows; /* successful growth steps */
    unsigned files;
    unsigned buffered_files; /* files the filesystem would not open with O_DIRECT */
    bool growable;
    const char *paths[NVME_MAX_DIRS]; /* the swap files; valid until nvme_close() */
};

/* Create (or with keep, reopen) the swap files and the logical space. io must outlive the
 * swap space. Returns 0, -EINVAL (bad options; with keep, files of different sizes),
 * -ENOENT/-EACCES/... (a directory or file that cannot be used, or with keep one swap file
 * of several missing; the path is logged), -EBUSY (a swap file is locked by another swap
 * space), -ENOSPC (preallocation failed), -ENOMEM. On error no file this call created is
 * left behind, and files it found (with keep) are as they were. */
int nvme_open(const struct nvme_opts *opts, struct uring *io, struct nvme **out);
/* Close (and with remove_on_close unlink) the files. No IO may be in flight on this swap
 * space. NULL is a no-op. */
void nvme_close(struct nvme *n);

/* Allocate bytes (rounded up to 4 KiB) of logical space; *off receives its start. Returns
 * 0, -EINVAL, -ENOSPC (logged once per failure; state unchanged), -EROFS (read-only) or
 * another -errno from growing the files. */
int nvme_alloc(struct nvme *n, uint64_t bytes, uint64_t *off);
/* The same where the caller holds a lock others wait on: it never grows the files (nor
 * waits for a growth) and answers -EAGAIN where only a growth would make room; the caller
 * drops its lock, calls nvme_grow_for() and tries again. */
int nvme_alloc_nogrow(struct nvme *n, uint64_t bytes, uint64_t *off);
/* Grow the files (if needed) until an allocation of bytes fits; 0 or nvme_alloc()'s
 * errors. fallocate runs with no lock held: allocations, frees and IO go on. */
int nvme_grow_for(struct nvme *n, uint64_t bytes);
/* Allocate [off, off + bytes rounded up to 4 KiB) at exactly that offset: after a keep
 * open, for each extent the caller knows to be in use. Returns 0, -EINVAL (0 bytes, off
 * not 4 KiB aligned, or the range passes the current capacity; it never grows the
 * space), -EEXIST when any part of the range is allocated already, -ENOMEM. nvme_free()
 * releases it like any allocation. */
int nvme_reserve(struct nvme *n, uint64_t off, uint64_t bytes);
/* Free the allocation that starts at off. -EINVAL when there is none. */
int nvme_free(struct nvme *n, uint64_t off);

/* Synchronous IO inside one allocation. Returns 0 or -errno (-EROFS: a write to a
 * read-only swap space). */
int nvme_read(struct nvme *n, uint64_t off, void *buf, size_t len);
int nvme_write(struct nvme *n, uint64_t off, const void *buf, size_t len);
/* Asynchronous IO: req->op, buf, len, off (logical), cb and data are the caller's;
 * file, map and map_data are filled here. Returns 0 (the callback will run once) or
 * -errno (it never runs). */
int nvme_submit(struct nvme *n, struct uring_req *req);
/* fdatasync() every swap file. Returns 0 or the first -errno. */
int nvme_sync(struct nvme *n);

void nvme_get_stats(struct nvme *n, struct nvme_stats *out);
/* The folder of swap file i, opened once at nvme_open (what else lives there, such as the
 * manifest, is reached relative to it, never through a link); -EINVAL without one. */
int nvme_dir_fd(struct nvme *n, unsigned i);

/* Test-only fault hook, compiled in and off by default: the nth fallocate() from now
 * (1 = the next one) fails with err (a positive errno, e.g. ENOSPC); 0 disarms it. */
void nvme_fault_fallocate(struct nvme *n, unsigned nth, int err);

#endif
