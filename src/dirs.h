/*
 * dirs.h - folders made durable: every folder zinf makes (a swap directory and the ones
 * above it, a daemon's swap directory and job folders, an export's folder) is made here, and
 * once made its parent is fsynced, so that after a power loss the folder, and all a flush
 * saved in it, is still there. A new entry in a directory is durable only once the directory
 * itself is synced; syncing the new folder (as a manifest's commit does) is not enough.
 *
 * Not here: the files inside (each writer syncs its own) or who may own the folder.
 */
#ifndef ZINF_DIRS_H
#define ZINF_DIRS_H

#include <sys/types.h>

/* mkdir(path, mode), then its parent synced. 0, or -errno: -EEXIST where something is at
 * path already (nothing is synced then). A folder whose parent cannot be synced is removed
 * again, and the error returned. */
int dirs_make(const char *path, mode_t mode);

/* mkdir -p: path and each folder missing above it, each made by dirs_make, parents first.
 * 0 when path is a folder at the end (made now or before), -ENOTDIR when it is something
 * else, or the first error. */
int dirs_make_all(const char *path, mode_t mode);

#endif
