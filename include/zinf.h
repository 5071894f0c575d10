/*
 * zinf.h - the public interface of zinf, a memory-tiering and offload engine that keeps
 * tensors in a device (GPU) <-> pinned host <-> NVMe hierarchy.
 *
 * Every function that returns int returns 0 (or a count) on success and a negative errno
 * on failure; errno is never the channel. This header is self-contained and C99/C++ clean.
 * It is not the internal API: the IO engine and swap space below it are not exported.
 */
#ifndef ZINF_H
#define ZINF_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define ZINF_API __attribute__((visibility("default")))
#else
#define ZINF_API
#endif

#define ZINF_VERSION_MAJOR 0
#define ZINF_VERSION_MINOR 1
#define ZINF_VERSION_PATCH 0

typedef struct zinf_engine zinf_engine;
typedef uint64_t zinf_tensor; /* 0 is never a valid handle */

enum zinf_tier { ZINF_TIER_DEVICE, ZINF_TIER_HOST, ZINF_TIER_NVME };
enum zinf_device_kind { ZINF_DEVICE_AUTO, ZINF_DEVICE_CUDA, ZINF_DEVICE_EMULATED };

/* zinf_options.flags.
 *
 * A swap directory that holds a saved state (the manifest zinf_flush and zinf_close write
 * there, naming at least one tensor, or one that cannot be read) is the caller's data: it
 * is never emptied by accident. Without RESUME, READONLY or OVERWRITE, zinf_open refuses
 * it with -EEXIST and logs one line naming the directory and these flags; where there is
 * no saved state it starts empty, creating nvme_path (and its parents) when missing.
 *
 * RESUME and READONLY want a saved state: where nvme_path does not exist or holds no
 * manifest they return -ENOENT ("no saved run in DIR") and create nothing.
 *
 * READONLY changes no byte in the swap directories: the swap files are opened read-only
 * and not locked, so it works next to a process that has them open, and sees the state
 * that process last flushed (read again if it is replaced during the open). Tensors homed
 * on NVMe are read when fetched or read, and every such read is checked against the
 * checksum the manifest gave: once that process has flushed a newer state it may reuse the
 * extent, and such a read returns -ESTALE (reopen to see the new state), never another
 * tensor's bytes (-EBADMSG where the manifest is unchanged: damage). What was read before
 * stays as it was read (stale, but the tensor's). Nothing is created, truncated or
 * flushed, zinf_close included. Calls that
 * would change the state return -EROFS: zinf_register, zinf_unregister, zinf_write,
 * zinf_flush, and a ZINF_RELEASE_DIRTY zinf_release (which keeps its pin: release it
 * clean). RESUME may be given with it; OVERWRITE may not (-EINVAL), nor RESUME with
 * OVERWRITE. */
#define ZINF_OPEN_RESUME (1u << 0)    /* reopen the tensors persisted in nvme_path */
#define ZINF_OPEN_NO_PIN (1u << 1)    /* do not lock the host tier in memory (pin_memory: false) */
#define ZINF_OPEN_OVERWRITE (1u << 2) /* start over: a saved state in nvme_path is deleted */
#define ZINF_OPEN_READONLY (1u << 3)  /* inspect the saved state in nvme_path; change nothing */
/* With RESUME or READONLY (alone, or with OVERWRITE: -EINVAL): open the previous version of
 * the saved state, the one a zinf_flush_step with ZINF_FLUSH_KEEP_PREVIOUS kept, rather than
 * the current one. READONLY inspects it and moves nothing; RESUME makes it the current one
 * (the newer version is forgotten). Where nvme_path holds no previous version the current
 * one is opened; where it holds neither, -ENOENT. NO_PIN combines with it. */
#define ZINF_OPEN_PREVIOUS (1u << 4)

/* zinf_release() flags */
#define ZINF_RELEASE_CLEAN 0u
#define ZINF_RELEASE_DIRTY (1u << 0) /* the caller wrote through the pointer: this copy is newest */
/* The caller is done with the content, and so is everyone: the tensor's content becomes zeros
 * (as a new tensor's, and a zero entry at the next flush) without moving a byte. Its copies
 * are dropped unwritten, and its next fetch fills zeros rather than reading the drive (a
 * gradient the update has consumed, which the next backward overwrites). Only for a tensor
 * homed on NVMe (-EINVAL otherwise), with no other pin on either copy (-EBUSY: another
 * caller still holds it); on error the pin stays. Not with DIRTY. */
#define ZINF_RELEASE_ZERO (1u << 1)

struct zinf_options {        /* zero-initialised = defaults */
    const char *nvme_path;   /* directory for swap files; NULL: no NVMe tier */
    size_t device_bytes;     /* device tier capacity; 0: default */
    size_t host_bytes;       /* pinned host tier capacity; 0: default */
    size_t block_size;       /* bytes per IO request; 0: 1 MiB */
    unsigned queue_depth;    /* IO requests in flight; 0: 32 */
    enum zinf_device_kind device_kind; /* AUTO: CUDA if a GPU is usable, else emulated */
    int cuda_device;         /* CUDA ordinal when CUDA is used */
    unsigned flags;          /* ZINF_OPEN_* */
    /* Extra swap directories (one per drive); extents are striped over nvme_path and
     * these in block_size units. NULL-terminated; NULL: nvme_path alone. */
    const char *const *nvme_paths_extra;
    uint64_t reserved[8];    /* must be zero */
};

struct zinf_tier_stats {
    uint64_t capacity_bytes;  /* the tier's budget */
    uint64_t used_bytes;      /* allocated to copies now */
    uint64_t peak_bytes;      /* the most ever allocated at once */
    uint64_t pinned_bytes;    /* held by callers between fetch and release */
    uint64_t fetches;         /* zinf_fetch/zinf_fetch_async calls for this tier */
    uint64_t hits;            /* ... that found a resident copy (prefetched ones included:
                                 zinf_stats.prefetch_in_time counts those again) */
    uint64_t evictions;       /* copies dropped to make room */
    uint64_t writebacks;      /* dirty copies written to their home first */
};

struct zinf_stats {
    struct zinf_tier_stats tier[3];  /* indexed by enum zinf_tier; NVMe: the swap space */
    uint64_t tensors;                /* registered now */
    uint64_t nvme_bytes_read, nvme_bytes_written;
    uint64_t prefetches;             /* loads started ahead of use (schedule or zinf_prefetch) */
    uint64_t prefetch_in_time;       /* ... whose copy was resident when fetched */
    uint64_t prefetch_late;          /* ... still arriving when fetched (the fetch joined it) */
    uint64_t prefetch_wasted;        /* ... evicted or dropped before any fetch used them */
    uint64_t blocked_ns;             /* total time callers spent blocked in fetch/wait */
    uint64_t steps;                  /* zinf_step() calls */
    uint64_t schedule_length;        /* fetches in the learned step; 0 while learning */
    uint64_t schedule_resets;        /* steps that diverged from the schedule */
    uint64_t flushes;
    unsigned io_buffered;            /* swap files opened without O_DIRECT */
    unsigned device_is_cuda;         /* 1: CUDA device tier, 0: emulated */
    uint64_t tensors_damaged;        /* resumed tensors whose saved content failed its
                                        checksum or could not be read: fetch and read of
                                        them answer -EBADMSG; their saved bytes are kept */
    uint64_t compactions;            /* zinf_fetch_all() calls that emptied a fragmented
                                        tier to lay their set out in one run */
    /* Of blocked_ns, what the waits were for: a load from NVMe (the caller's own or one it
     * joined), a copy between host and device memory, room (a write-back, or swap files
     * growing, before a copy can be evicted), and a pin: another caller's hold on the copy
     * needed, or a transfer reading it. The rest of blocked_ns is the work between waits. */
    uint64_t blocked_nvme_ns, blocked_copy_ns, blocked_room_ns, blocked_pin_ns;
    /* The flush running now, or the last one: the bytes of the tensors it covers, and of
     * those it has been through (written, or checked unchanged): its progress, for a caller
     * that watches it from another thread. */
    uint64_t flush_bytes_total, flush_bytes_done;
    /* The host tier's staging area (bytes kept beside the arena for copies to and from
     * NVMe; 0: none), and whether the host tier is locked in memory (1) or runs unpinned
     * (0: ZINF_OPEN_NO_PIN, or the lock failed). Through a daemon: the daemon's. */
    uint64_t host_staging_bytes;
    unsigned host_pinned;
    /* Write-behinds: of the tiers' writebacks, those started when the copy was released
     * DIRTY rather than when its room was needed (the learned step says the tier cycles
     * and the tensor is not fetched to it again in the step). */
    uint64_t write_behinds;
};

/* What zinf_tensor_info() tells of a registered tensor. */
struct zinf_tensor_info {
    enum zinf_tier home; /* where its permanent copy lives (as registered, or as saved) */
    uint64_t bytes;      /* its size as registered */
};

/* Open an engine. opt may be NULL (all defaults). */
ZINF_API int zinf_open(const struct zinf_options *opt, zinf_engine **out);
/* Open an engine from a DeepSpeed-style JSON config (see `zinf config check`). */
ZINF_API int zinf_open_config(const char *json_path, zinf_engine **out);
/* The same with ZINF_OPEN_* flags (RESUME, OVERWRITE, READONLY, NO_PIN), as zinf_open
 * takes them in zinf_options.flags: how a config's swap directory with a saved state is
 * resumed, inspected or started over. -EINVAL for an unknown flag. */
ZINF_API int zinf_open_config_flags(const char *json_path, unsigned flags, zinf_engine **out);
/* The parsed form of a DeepSpeed-style JSON config. It is opaque here: programs built with
 * zinf's own config parser (its tools and trainer) fill one and open it with
 * zinf_open_parsed; others give the file to zinf_open_config_flags. */
struct zinf_config;
/* Open an engine from a parsed config, with ZINF_OPEN_* flags as zinf_open_config_flags
 * takes them (ZINF_OPEN_PREVIOUS too). The config is only read, and may be freed once this
 * returns. -EINVAL for a NULL config or out, or an unknown flag; then as zinf_open. */
ZINF_API int zinf_open_parsed(const struct zinf_config *cfg, unsigned flags, zinf_engine **out);
/* Connect to the zinf daemon listening on socket (`zinf serve`) and attach to its job of
 * that name (letters, digits, '.', '_', '-'; at most 64 bytes; created on first use, owned
 * by the caller's uid). Every call of this header then behaves on the handle exactly as on
 * an engine of this process, and zinf_close ends the connection (flushing the job first).
 * Fetched pointers are the daemon's memory, mapped into this process. -ENOENT or
 * -ECONNREFUSED when no daemon listens there, -EACCES for another uid's job, -EINVAL for a
 * bad job name. If the daemon stops or dies, every later call on the handle answers
 * -ECONNRESET (it does not reconnect: call zinf_connect again once a daemon runs; what the
 * job flushed is there); zinf_close still frees it. A zinf_write or zinf_read is as whole as
 * embedded (the daemon stages a large one and applies it at once); one of more bytes than
 * the daemon stages for a session (zinf.serve.write_stage_bytes, 1 GiB) is -EMSGSIZE. */
ZINF_API int zinf_connect(const char *socket, const char *job, zinf_engine **out);
/* The same, read-only, to a job that exists: the caller's own, or another uid's that its
 * owner shared (`zinf job share`; -EACCES otherwise, -ENOENT for no such job). Its arenas
 * are mapped PROT_READ (a fetched pointer is read, never written), and every call that
 * would change the job answers -EROFS: zinf_register, zinf_unregister, zinf_zero,
 * zinf_write, zinf_flush and a release with flags. zinf_close flushes nothing. Several
 * jobs fine-tuning one base each attach to it so: the daemon holds one copy of it for all,
 * and reads it from NVMe once for all when they fetch it together. */
ZINF_API int zinf_connect_readonly(const char *socket, const char *job, zinf_engine **out);
/* Flush (when there is an NVMe tier), wait for everything in flight, free. NULL: no-op. */
ZINF_API void zinf_close(zinf_engine *e);
/* The same without the flush, for a caller that knows its tensors in memory are
 * inconsistent (a step torn half way): the last flush stays the saved state, as after a
 * crash. On a zinf_connect handle it ends the connection without asking the job to flush:
 * what was written stays in the daemon's memory, and the daemon flushes it when it closes
 * the job (idle, `zinf job close`, or its own shutdown). NULL: no-op. */
ZINF_API void zinf_close_unflushed(zinf_engine *e);

/* Register a tensor of nbytes whose permanent copy lives in home. Content starts as
 * zeros. -EEXIST for a name in use, -ENOSPC when larger than the home tier. */
ZINF_API int zinf_register(zinf_engine *e, const char *name, size_t nbytes,
                           enum zinf_tier home, zinf_tensor *out);
ZINF_API int zinf_lookup(zinf_engine *e, const char *name, zinf_tensor *out);
/* -EBUSY while any copy is pinned. */
ZINF_API int zinf_unregister(zinf_engine *e, zinf_tensor t);
/* A registered tensor's home and size (a resumed tensor's are the saved run's). -EINVAL
 * for a NULL engine or out, -ENOENT for a handle that names no tensor. Read-only engines
 * and zinf_connect handles answer it too. */
ZINF_API int zinf_tensor_info(zinf_engine *e, zinf_tensor t, struct zinf_tensor_info *out);

/* Make the tensor resident in tier (DEVICE or HOST) and pin it; *ptr stays valid and
 * unmoved until the matching zinf_release(). Blocks until the copy is there. */
ZINF_API int zinf_fetch(zinf_engine *e, zinf_tensor t, enum zinf_tier tier, void **ptr);
/* The same without blocking: the pin is taken now, the pointer comes from zinf_wait(). */
ZINF_API int zinf_fetch_async(zinf_engine *e, zinf_tensor t, enum zinf_tier tier,
                              uint64_t *ticket);
ZINF_API int zinf_wait(zinf_engine *e, uint64_t ticket, void **ptr);
/* Fetch a set of n tensors to tier and pin them all (ptrs[i] for ts[i]), or none: on error
 * every pin it took is dropped again. Where the set fits in the tier but the tier is too
 * fragmented to place it (-ENOMEM from the member-by-member fetches), it evicts every
 * unpinned copy of the tier (writing dirty ones back), and lays the set out again from the
 * start of the arena, with no prefetch in between. So when the caller and no other thread
 * holds any pin in the tier, a set whose sizes (each rounded up to 4 KiB, those homed in
 * the tier not counted) add up to at most the tier's capacity less its homes always fits:
 * a trainer that fetches each phase as one set needs exactly its largest set, never more.
 * zinf_stats.compactions counts the calls that had to empty the tier. */
ZINF_API int zinf_fetch_all(zinf_engine *e, const zinf_tensor *ts, size_t n, enum zinf_tier tier,
                            void **ptrs);
/* Drop one pin. ZINF_RELEASE_DIRTY: the caller wrote through the pointer; ZINF_RELEASE_ZERO:
 * nobody needs the content again (above). */
ZINF_API int zinf_release(zinf_engine *e, zinf_tensor t, enum zinf_tier tier, unsigned flags);
/* The tensor's content becomes zeros, as after a ZINF_RELEASE_ZERO, without a pin: nobody
 * needs it again (a gradient set to none before the backward that overwrites it). No byte
 * moves: its copies are dropped unwritten, its next fetch fills zeros rather than reading the
 * drive, and a flush saves a zero entry. Only for a tensor homed on NVMe (-EINVAL otherwise,
 * and for a handle that names no tensor), while nobody holds a pin on it or waits for one
 * (-EBUSY, the content unchanged); -EROFS on a read-only engine. */
ZINF_API int zinf_zero(zinf_engine *e, zinf_tensor t);
/* A hint: start bringing the tensor to tier; no pin, never blocks, never fails for lack
 * of room (the hint is dropped instead). */
ZINF_API int zinf_prefetch(zinf_engine *e, zinf_tensor t, enum zinf_tier tier);
/* Mark the end of one training step (the schedule is learned between two marks). */
ZINF_API int zinf_step(zinf_engine *e);

/* Copy bytes into / out of a tensor's content, wherever its newest copy is. */
ZINF_API int zinf_write(zinf_engine *e, zinf_tensor t, size_t off, const void *src, size_t n);
ZINF_API int zinf_read(zinf_engine *e, zinf_tensor t, size_t off, void *dst, size_t n);
/* Make every tensor's content durable in nvme_path (fsync, manifest replaced atomically).
 * Each tensor is saved whole, as one version: a copy nobody holds is read where there is one.
 * Where only a caller's pin holds the newest content (another thread may be writing through
 * it), the flush waits for its release, up to 200 ms in all, then reads it as it is (the
 * flushing thread's own pins, which it is not writing through meanwhile). */
ZINF_API int zinf_flush(zinf_engine *e);
/* zinf_flush_step() flags */
#define ZINF_FLUSH_KEEP_PREVIOUS (1u << 0) /* keep the saved state it replaces, as the previous version */
/* zinf_flush, the saved state tagged with step (a training step, say; -1: no tag), which
 * zinf_saved_steps reads back. With ZINF_FLUSH_KEEP_PREVIOUS the state it replaces is kept
 * as the previous version (ZINF_OPEN_PREVIOUS opens it; a version kept before goes, so
 * there are at most two), until zinf_drop_previous or a flush without the flag. A group of
 * processes that must save a step all or none keeps it, meets, then drops it. 0 with
 * nothing done when there is no NVMe tier. -EINVAL for a NULL engine, a step below -1 or
 * an unknown flag, -EROFS on a READONLY engine, -ENOTSUP on a zinf_connect handle (the
 * daemon's jobs keep one version: use zinf_flush); then as zinf_flush. */
ZINF_API int zinf_flush_step(zinf_engine *e, int64_t step, unsigned flags);
/* Forget the previous version that ZINF_FLUSH_KEEP_PREVIOUS kept: its manifest is removed
 * and its swap space freed (waiting for a flush in progress to end). 0 when there is none,
 * or no NVMe tier. -EINVAL for a NULL engine, -EROFS on a READONLY engine, -ENOTSUP on a
 * zinf_connect handle. */
ZINF_API int zinf_drop_previous(zinf_engine *e);
/* The steps the saved state in swap directory dir was flushed with: steps[0] the current
 * version's, steps[1] the previous version's, -1 where a version has no tag or there is
 * none. Reads the manifests only; opens no engine and locks nothing, so it works next to a
 * process using dir. -EINVAL for NULL arguments, -ENOENT where dir (or a saved state in it)
 * does not exist, another -errno when a manifest cannot be read. */
ZINF_API int zinf_saved_steps(const char *dir, int64_t steps[2]);
/* When the saved state in dir was last committed: *ns, nanoseconds since the epoch (its
 * manifest's modification time). -EINVAL for NULL arguments, -ENOENT where dir (or a saved
 * state in it) does not exist, another -errno. Opens no engine. */
ZINF_API int zinf_saved_at(const char *dir, int64_t *ns);
/* Whether dir holds a saved state: 0 with *ntensors the tensors its manifest names (SIZE_MAX
 * when it cannot be read: a saved state all the same, never emptied by accident), -ENOENT
 * where dir or a manifest in it does not exist, -EINVAL for NULL arguments, another -errno
 * when it cannot tell. Opens no engine. */
ZINF_API int zinf_saved_tensors(const char *dir, size_t *ntensors);
/* Remove the saved state of swap directory dir without opening an engine, as
 * ZINF_OPEN_OVERWRITE would: its manifests (then it is no saved state), then the swap files
 * of dir and of extra (NULL-terminated, as zinf_options.nvme_paths_extra; NULL: dir alone).
 * Only those names are removed, each only where it is this user's regular file, reached
 * without following a link; nothing else in the directories is touched. 0, also where
 * nothing is saved (or dir does not exist); -EBUSY where an engine holds a swap file
 * (waited for up to three seconds, as a resume does; nothing removed); -EACCES where one of
 * those names is something else (nothing removed); -EINVAL for a NULL dir or more than 16
 * directories; another -errno. */
ZINF_API int zinf_saved_remove(const char *dir, const char *const *extra);
ZINF_API int zinf_stats(zinf_engine *e, struct zinf_stats *out);

/* AdamW for trainers that keep their parameters and optimizer states in zinf (fetch them to
 * the host tier, step, release them dirty): torch.optim.AdamW's update with decoupled
 * weight decay, p -= lr * (m^ / (sqrt(v^) + eps) + weight_decay * p), m^ and v^ the moments
 * with their bias corrections. It runs the widest SIMD kernel this CPU has, over the
 * library's OpenMP threads cut at points fixed by n alone: the same inputs give the same
 * bits whatever the number of threads (not across CPUs with other kernels, whose results
 * differ in rounding). */
struct zinf_adamw {
    float lr;           /* >= 0 */
    float beta1, beta2; /* in [0, 1) */
    float eps;          /* > 0 */
    float weight_decay; /* >= 0 */
    uint64_t reserved[4]; /* must be zero */
};
/* torch.optim.AdamW's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01. */
ZINF_API void zinf_adamw_defaults(struct zinf_adamw *h);
/* One step over n fp32 elements in place on param, m and v (host memory); step is Adam's
 * count from 1; grad_scale multiplies grad first (1: as it is; a clipping factor, or
 * 1 / loss scale). -EINVAL (nothing changed) for a NULL buffer with n > 0, step < 1, a
 * hyper-parameter out of its range, a grad_scale that is not finite, or reserved not zero. */
ZINF_API int zinf_adamw_step(const struct zinf_adamw *h, int step, float *param,
                             const float *grad, float *m, float *v, size_t n, float grad_scale);

/* The library's version as "MAJOR.MINOR.PATCH". */
/* Where the library's messages go (notices such as "the host tier runs unpinned", and the
 * reason behind an error code: the file, the limit). Default: stderr, "zinf: " first, at
 * the level ZINF_LOG names in the environment (error, warn, notice or debug, or 0-3;
 * default notice). Once fn is set the library prints nothing itself: each message at or
 * below level is handed to fn(level, msg, user), one line without its newline, from
 * whichever thread logs it (never two at once, so fn must not call the library). fn NULL:
 * back to stderr. level < 0: keep the level as it is. */
#define ZINF_LOG_ERROR 0
#define ZINF_LOG_WARN 1
#define ZINF_LOG_NOTICE 2
#define ZINF_LOG_DEBUG 3
ZINF_API void zinf_set_log(void (*fn)(int level, const char *msg, void *user), void *user,
                           int level);
ZINF_API const char *zinf_version(void);

/* A message for a negative errno returned by zinf (or any errno); never NULL. */
ZINF_API const char *zinf_strerror(int err);

#ifdef __cplusplus
}
#endif
#endif /* ZINF_H */
