/*
 * folders.c - the daemon's folders (folders.h): its swap directories, checked at start, and
 * each job's folder under them, the daemon's alone.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "dirs.h"
#include "service/folders.h"

bool folders_own(const struct stat *st, mode_t others)
{
    return S_ISDIR(st->st_mode) && st->st_uid == geteuid() && !(st->st_mode & others);
}

static void refuse_folder(const char *job, const char *path, const struct stat *st)
{
    unsigned me = (unsigned)geteuid();
    if (S_ISLNK(st->st_mode) || !S_ISDIR(st->st_mode))
        log_error("serve: job %s: %s is not a folder (%s): refused; remove it to start the job "
                  "anew", job, path, S_ISLNK(st->st_mode) ? "a symbolic link" : "another kind of file");
    else
        log_error("serve: job %s: its folder %s belongs to uid %u with mode %04o, not to the "
                  "daemon (uid %u) alone: refused, as a folder another user can write is not "
                  "trusted. Folders of an earlier zinf were given to their job's user; to keep "
                  "such a job: chown -R %u %s && chmod 0700 %s && echo %u > %s/" FOLDERS_OWNER_FILE,
                  job, path, (unsigned)st->st_uid, (unsigned)(st->st_mode & 07777), me, me, path,
                  path, (unsigned)st->st_uid, path);
}

/* The uid the owner file of folder path names: 0 with *owner, -ENOENT where there is none,
 * -EBADMSG where it is not a uid, -errno. Read without following a link or waiting on a
 * FIFO. */
int folders_read_owner(const char *path, uid_t *owner)
{
    char buf[32];
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) return -errno;
    int fd = openat(dfd, FOLDERS_OWNER_FILE, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    int r = fd < 0 ? -errno : 0;
    close(dfd);
    if (r < 0) return r;
    struct stat st;
    ssize_t n = -1;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return -EBADMSG;
    buf[n] = 0;
    char *end;
    unsigned long v = strtoul(buf, &end, 10);
    if (end == buf || (*end && *end != '\n') || v > UINT32_MAX - 1) return -EBADMSG;
    *owner = (uid_t)v;
    return 0;
}

static int sync_folder(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int r = fd < 0 || fsync(fd) != 0 ? -errno : 0;
    if (fd >= 0) close(fd);
    return r;
}

int folders_read_shared(const char *path)
{
    struct stat st;
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) return -errno;
    int r = fstatat(dfd, FOLDERS_SHARED_FILE, &st, AT_SYMLINK_NOFOLLOW) == 0 ? 0 : -errno;
    close(dfd);
    if (r == -ENOENT) return 0;
    /* Only a plain file the daemon made grants anything. */
    return r < 0 ? r : S_ISREG(st.st_mode) && st.st_uid == geteuid();
}

int folders_set_shared(const char *path, bool on)
{
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) return -errno;
    int r = 0;
    if (on) {
        int fd = openat(dfd, FOLDERS_SHARED_FILE,
                        O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
        if (fd < 0 || fsync(fd) != 0) r = -errno;
        if (fd >= 0) close(fd);
    } else if (unlinkat(dfd, FOLDERS_SHARED_FILE, 0) != 0 && errno != ENOENT) {
        r = -errno;
    }
    if (r == 0 && fsync(dfd) != 0) r = -errno;
    close(dfd);
    return r;
}

/* Makes the first folder of a new job, whole or not at all: a hidden folder (no job's name
 * starts with a dot) with the owner file in it, renamed into place. */
static int make_first_folder(const char *root, const char *path, uid_t uid)
{
    char tmp[4200], f[4300], text[32];
    snprintf(tmp, sizeof(tmp), "%s/.new-XXXXXX", root);
    if (!mkdtemp(tmp)) return -errno; /* 0700 */
    snprintf(f, sizeof(f), "%s/%s", tmp, FOLDERS_OWNER_FILE);
    int n = snprintf(text, sizeof(text), "%u\n", (unsigned)uid);
    int fd = open(f, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    int r = fd < 0 ? -errno : 0;
    if (r == 0 && (write(fd, text, (size_t)n) != n || fsync(fd) != 0)) r = errno ? -errno : -EIO;
    if (fd >= 0) close(fd);
    if (r == 0 && (r = sync_folder(tmp)) == 0 && rename(tmp, path) != 0) r = -errno;
    if (r == 0) return sync_folder(root);
    unlink(f);
    rmdir(tmp);
    return r;
}

/* The job's folder under each swap directory, made when missing, each checked to be the
 * daemon's alone; *owner: the job's owner (uid, for a job made now). No swap directory:
 * owner uid, in memory only. -EACCES for a folder refused (the log says why). */
int folders_job(const struct config_paths *roots, const char *name, uid_t uid, uid_t *owner)
{
    *owner = uid;
    for (unsigned i = 0; i < roots->count; i++) {
        const char *root = roots->path[i];
        char path[4096];
        struct stat st;
        if (snprintf(path, sizeof(path), "%s/%s", root, name) >= (int)sizeof(path))
            return -ENAMETOOLONG;
        int r = lstat(path, &st) == 0 ? 0 : -errno;
        if (r == -ENOENT) {
            r = i == 0 ? make_first_folder(root, path, uid) : dirs_make(path, 0700);
            if (r == 0 && (r = lstat(path, &st) == 0 ? 0 : -errno) == 0 && i == 0) {
                log_notice("serve: job %s: made its folder %s (owner uid %u)", name, path,
                           (unsigned)uid);
            }
        }
        if (r < 0) {
            log_error("serve: job %s: cannot make its folder %s: %s", name, path, strerror(-r));
            return r;
        }
        if (!folders_own(&st, 077)) {
            refuse_folder(name, path, &st);
            return -EACCES;
        }
        if (i > 0) continue;
        r = folders_read_owner(path, owner);
        if (r == -ENOENT) {
            *owner = geteuid(); /* a folder without one: the daemon's user's (and root's) */
        } else if (r < 0) {
            log_error("serve: job %s: %s/%s: %s: refused", name, path, FOLDERS_OWNER_FILE,
                      r == -EBADMSG ? "not a uid" : strerror(-r));
            return -EACCES;
        }
    }
    return 0;
}

/* A swap directory the daemon keeps every job's files in, made (0700, with the folders above
 * it that are missing) when missing: it must
 * be the daemon's and writable by nobody else, and every folder above it root's or the
 * daemon's and writable by nobody else unless sticky (as /tmp: another user can neither move
 * nor remove what is not theirs there), as sshd's StrictModes and PostgreSQL's data
 * directory check have it. 0, or -EPERM with err saying what and how to fix it. */
int folders_check_root(const char *path, char *err, size_t errlen)
{
    unsigned me = (unsigned)geteuid();
    struct stat st;
    /* mkdir -p, each folder made 0700 and durable */
    int made = dirs_make_all(path, 0700);
    if (made < 0 && made != -ENOTDIR) {
        snprintf(err, errlen, "serve: swap directory %s: cannot make it: %s", path,
                 strerror(-made));
        return made;
    }
    char real[PATH_MAX];
    if (!realpath(path, real) || stat(real, &st) != 0) {
        int r = -errno;
        snprintf(err, errlen, "serve: swap directory %s: %s", path, strerror(-r));
        return r;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(err, errlen, "serve: swap directory %s is not a folder", path);
        return -ENOTDIR;
    }
    if (!folders_own(&st, 022)) {
        snprintf(err, errlen,
                 "serve: swap directory %s%s%s belongs to uid %u with mode %04o: the daemon (uid "
                 "%u) keeps every job's files there, and only in a folder that is its own and "
                 "that nobody else can write to. Fix: chown %u %s && chmod 0700 %s (or name "
                 "another nvme_path)",
                 path, strcmp(path, real) ? " = " : "", strcmp(path, real) ? real : "",
                 (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777), me, me, real, real);
        return -EPERM;
    }
    for (char *slash = strrchr(real, '/'); slash; slash = strrchr(real, '/')) {
        if (slash == real) slash[1] = 0; /* up to "/" */
        else *slash = 0;
        if (stat(real, &st) != 0) {
            int r = -errno;
            snprintf(err, errlen, "serve: swap directory %s: %s: %s", path, real, strerror(-r));
            return r;
        }
        if ((st.st_uid != 0 && st.st_uid != (uid_t)me) ||
            ((st.st_mode & 022) && !(st.st_mode & S_ISVTX))) {
            snprintf(err, errlen,
                     "serve: swap directory %s: the folder %s above it belongs to uid %u with "
                     "mode %04o: another user could move the swap directory away and put "
                     "another in its place. Fix: chmod go-w %s, or name an nvme_path under "
                     "folders only root (or uid %u) can write",
                     path, real, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777), real, me);
            return -EPERM;
        }
        if (!strcmp(real, "/")) break;
    }
    return 0;
}

/* Empties and removes the folder name in the folder rootfd: every entry unlinked, none
 * followed. */
static int remove_one(int rootfd, const char *root, const char *name)
{
    int fd = openat(rootfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -errno;
    struct stat st;
    if (fstat(fd, &st) != 0 || !folders_own(&st, 077)) {
        close(fd);
        log_error("serve: job %s: its folder in %s is not the daemon's alone: not removed", name,
                  root);
        return -EACCES;
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        int r = -errno;
        close(fd);
        return r;
    }
    int r = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if (unlinkat(dirfd(d), de->d_name, 0) != 0 && errno != ENOENT) {
            r = errno == EISDIR ? -ENOTEMPTY : -errno;
            log_error("serve: job %s: cannot remove %s/%s/%s: %s", name, root, name, de->d_name,
                      strerror(-r));
        }
    }
    if (r == 0 && fsync(dirfd(d)) != 0) r = -errno;
    closedir(d);
    if (r == 0 && unlinkat(rootfd, name, AT_REMOVEDIR) != 0) r = -errno;
    if (r == 0 && fsync(rootfd) != 0) r = -errno;
    return r;
}

int folders_remove_job(const struct config_paths *roots, const char *name)
{
    int r = -ENOENT, found = 0;
    /* The first one last: until its owner file goes, the job is still someone's. */
    for (unsigned k = roots->count; k-- > 0;) {
        int rootfd = open(roots->path[k], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (rootfd < 0) return -errno;
        int q = remove_one(rootfd, roots->path[k], name);
        close(rootfd);
        if (q == -ENOENT) continue;
        found++;
        if (q < 0) return q;
        r = 0;
    }
    return found ? r : -ENOENT;
}
