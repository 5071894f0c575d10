/*
 * dirs.c - folders made durable (dirs.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dirs.h"

/* fsync the folder that holds path. A filesystem that cannot sync a folder (EINVAL: some
 * FUSE ones) has nothing to make durable. */
static int sync_parent(const char *path)
{
    char parent[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash) {
        strcpy(parent, ".");
    } else {
        size_t n = slash == path ? 1 : (size_t)(slash - path);
        if (n >= sizeof(parent)) return -ENAMETOOLONG;
        memcpy(parent, path, n);
        parent[n] = '\0';
    }
    int fd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    int r = fsync(fd) < 0 && errno != EINVAL ? -errno : 0;
    close(fd);
    return r;
}

int dirs_make(const char *path, mode_t mode)
{
    if (mkdir(path, mode) < 0) return -errno;
    int r = sync_parent(path);
    if (r < 0) rmdir(path); /* not durable: made again by the next try, and synced then */
    return r;
}

int dirs_make_all(const char *path, mode_t mode)
{
    char buf[PATH_MAX];
    size_t n = strlen(path);
    struct stat st;

    if (n == 0) return -ENOENT;
    if (n >= sizeof(buf)) return -ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    while (n > 1 && buf[n - 1] == '/')
        buf[--n] = '\0';
    for (char *p = buf + 1;; p++) {
        bool end = *p == '\0';
        if (!end && *p != '/') continue;
        *p = '\0';
        int r = dirs_make(buf, mode);
        if (r < 0 && r != -EEXIST) return r;
        if (end) break;
        *p = '/';
    }
    if (stat(buf, &st) < 0) return -errno;
    return S_ISDIR(st.st_mode) ? 0 : -ENOTDIR;
}
