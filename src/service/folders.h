/*
 * folders.h - the daemon's folders. Each swap directory (an nvme_path of the daemon's config)
 * must be the daemon's and writable by nobody else, under folders only root or the daemon's
 * user can write (or sticky, as /tmp): another user could otherwise put a job's folder, or
 * the swap directory itself, where the daemon will write as root. A job's folder under each
 * of them is made by the daemon (0700, its own), never given to the job's user: clients
 * reach their data only through the protocol. The job's owner is the uid the first folder's
 * FOLDERS_OWNER_FILE names (a folder without one is the daemon's user's and root's).
 *
 * Not here: what a job's engine keeps in its folder (engine/manifest.c, tiers/nvme.c; they
 * open nothing through a link and wait on no FIFO).
 */
#ifndef ZINF_SERVICE_FOLDERS_H
#define ZINF_SERVICE_FOLDERS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "config.h"

#define FOLDERS_OWNER_FILE "zinf-owner"
/* Present (empty, the daemon's) in the first folder of a job its owner shared read-only
 * (zinf job share): a base that every uid may attach to read-only. */
#define FOLDERS_SHARED_FILE "zinf-shared"

/* Whether st is a folder of the daemon's (its effective uid) that no one else may write
 * (mode & others == 0). */
bool folders_own(const struct stat *st, mode_t others);

/* Checks a swap directory, made (0700, with the missing folders above it) when missing:
 * 0, or -errno (-EPERM: not the daemon's alone) with err naming the folder and the fix. */
int folders_check_root(const char *path, char *err, size_t errlen);

/* The folder of job name under each of roots, made when missing (the first one whole, with
 * its owner file naming uid), each checked to be the daemon's alone; *owner: the job's
 * owner. -EACCES for a folder refused, logged with the reason and the fix. */
int folders_job(const struct config_paths *roots, const char *name, uid_t uid, uid_t *owner);

/* The uid the owner file of the job folder at path names: 0, -ENOENT where it has none,
 * -EBADMSG where it is not a uid, -errno. Never through a link, never waiting on a FIFO. */
int folders_read_owner(const char *path, uid_t *owner);

/* Whether the job folder at path holds FOLDERS_SHARED_FILE: 1, 0, or -errno of the folder
 * (-ENOENT: none). Never through a link. */
int folders_read_shared(const char *path);

/* Puts FOLDERS_SHARED_FILE in the job folder at path (on) or takes it out, durably: 0 or
 * -errno. */
int folders_set_shared(const char *path, bool on);

/* Removes job name's folder under each of roots and what is in it (files only; a folder
 * found inside is left, and -ENOTEMPTY returned), without following a link. The folders
 * must be the daemon's (-EACCES); none at all is -ENOENT. The job must not be open. */
int folders_remove_job(const struct config_paths *roots, const char *name);

#endif
