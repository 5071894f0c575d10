/*
 * resume.c - ZINF_OPEN_RESUME and ZINF_OPEN_READONLY: which manifest is read (the current
 * one, or the previous version when going back to it), whether it was written with the same
 * striping, and every tensor it names brought back (its extent reserved, its home copy
 * loaded, every checksum checked); a tensor that fails stays registered, marked damaged.
 *
 * Not here: why the manifest and the extents are what they are (persist.c, whose opening
 * comment holds the crash-safety rule and the two versions), or the manifest file itself
 * (manifest.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/manifest.h"
#include "tiers/nvme.h"

struct resume_progress resume_progress;

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
                      mpath, t->name, t->nbytes, manifest_tier_name(home));
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
    int dfd = manifest_dir_fd(e);
    struct stat st;
    bool have_cur = fstatat(dfd, manifest_rel(dfd, cur), &st, AT_SYMLINK_NOFOLLOW) == 0,
         have_prev = fstatat(dfd, manifest_rel(dfd, prev), &st, AT_SYMLINK_NOFOLLOW) == 0;
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
        if (renameat(dfd, manifest_rel(dfd, prev), dfd, manifest_rel(dfd, cur)) < 0 ||
            manifest_sync_dir(e) < 0) {
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
        if (!ro && (renameat(dfd, manifest_rel(dfd, prev), dfd, manifest_rel(dfd, cur)) < 0 ||
                    manifest_sync_dir(e) < 0))
            return -errno;
        return 0;
    }
    snprintf(path, len, "%s", cur);
    if (have_prev && !ro &&
        (unlinkat(dfd, manifest_rel(dfd, prev), 0) < 0 || manifest_sync_dir(e) < 0))
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
    root = manifest_load(manifest_dir_fd(e), path, JSON_REJECT_DUPLICATES, &jerr, &err);
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
