/*
 * manifest.h - the manifest file's internals (manifest.c), shared by the two files that
 * write and read what it says: persist.c (a flush) and resume.c (an open that resumes).
 *
 * Not here: the engine's calls on a saved state (persist_*, in engine.h), or what a
 * manifest names (persist.c's opening comment).
 */
#ifndef ZINF_ENGINE_MANIFEST_H
#define ZINF_ENGINE_MANIFEST_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "engine/engine.h"

#define PREV_SUFFIX ".prev" /* the previous version's manifest: the current one's name + this */
#define MANIFEST_FORMAT "zinf-manifest"
#define MANIFEST_VERSION 1

/* The path of e's manifest, with suffix ("": the current one; PREV_SUFFIX; ".tmp"). */
void manifest_path(struct zinf_engine *e, char *buf, size_t len, const char *suffix);
/* The folder of e's manifest, for the *at() calls: an fd, or AT_FDCWD where there is none. */
int manifest_dir_fd(struct zinf_engine *e);
/* path as the *at() calls on dir_fd take it: its last component, or all of it for AT_FDCWD. */
const char *manifest_rel(int dir_fd, const char *path);
/* fsync the manifest's folder: 0 or -errno. */
int manifest_sync_dir(struct zinf_engine *e);
/* The manifest at path (in folder dfd), parsed with json_loadb's flags; NULL with *err:
 * -EBADMSG for bad JSON (with jerr), -ELOOP for a link, -EINVAL for anything but a regular
 * file, or another -errno. */
json_t *manifest_load(int dfd, const char *path, size_t flags, json_error_t *jerr, int *err);
/* Put text in place as e's manifest, durably; with keep, the current one becomes the
 * previous version. *renamed: whether it took the old one's place (then both must stay
 * readable, even when an error is returned). 0 or -errno. */
int manifest_commit(struct zinf_engine *e, const char *text, bool keep, bool *renamed);
/* A tier's name in a manifest: "device", "host" or "nvme". */
const char *manifest_tier_name(enum zinf_tier t);

#endif
