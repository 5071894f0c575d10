/*
 * trainer_layouts.c - the saved runs a swap path holds, in every layout a run can have: P
 * pipeline stages of N ranks each (P 1: no pipeline; N 1: no ZeRO ranks), stage S's rank R
 * keeping its swap files under each nvme path in [stage-S-of-P/][rank-R-of-N]. Here: those
 * folders and their names, the choice of the run a resume goes to (the newest step saved
 * whole by every folder of its layout), what trainer_open makes of it (resume, re-cut,
 * refuse a new run over it), and the removal of the other layouts' runs that --overwrite
 * asks for.
 *
 * Not here: the saved state's checks and the re-cut itself (trainer_resume.c), the folders
 * of this run's own stage and rank (trainer_pipe.c, trainer_shards.c).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "config.h"
#include "train/trainer_impl.h"

#define MAX_LAYOUTS 128 /* layouts looked at under one path: more are passed over */

const char *train_root(const struct trainer *t, unsigned k)
{
    return t->root[k] ? t->root[k] : t->base[k];
}

/* Whether the path as given holds a tensor- or sequence-parallel rank's folder
 * (tp-R-of-T, sp-R-of-S, stage-S-of-P.tp-R-of-T...), its name in name. */
static bool other_parallel(const struct trainer *t, char *name, size_t len)
{
    DIR *d = t->nbase ? opendir(train_root(t, 0)) : NULL;
    struct dirent *de;
    bool found = false;
    while (d && !found && (de = readdir(d)))
        if ((strstr(de->d_name, "tp-") || strstr(de->d_name, "sp-")) &&
            strstr(de->d_name, "-of-")) {
            snprintf(name, len, "%s", de->d_name);
            found = true;
        }
    if (d) closedir(d);
    return found;
}

char *train_layout_dir(const char *root, int P, int N, int s, int q)
{
    char *d = NULL;
    int n;
    if (P <= 1 && N <= 1) return strdup(root);
    if (P <= 1)
        n = asprintf(&d, "%s/rank-%d-of-%d", root, q, N);
    else if (N <= 1)
        n = asprintf(&d, "%s/stage-%d-of-%d", root, s, P);
    else
        n = asprintf(&d, "%s/stage-%d-of-%d/rank-%d-of-%d", root, s, P, q, N);
    return n < 0 ? NULL : d;
}

const char *train_layout_name(int P, int N, char *buf, size_t len)
{
    if (P <= 1 && N <= 1)
        snprintf(buf, len, "one rank");
    else if (P <= 1)
        snprintf(buf, len, "%d ranks", N);
    else if (N <= 1)
        snprintf(buf, len, "%d pipeline stages", P);
    else
        snprintf(buf, len, "%d pipeline stages x %d ranks", P, N);
    return buf;
}

const char *train_folder_name(int P, int N, int f, char *buf, size_t len)
{
    if (P <= 1)
        snprintf(buf, len, "rank %d", f);
    else if (N <= 1)
        snprintf(buf, len, "stage %d", f);
    else
        snprintf(buf, len, "stage %d rank %d", f / N, f % N);
    return buf;
}

/* ---- the layouts under a path ------------------------------------------------------- */

struct layout {
    int P, N;
};

/* Whether entry `name` of d is a folder (not a link to one) named WHAT-A-of-B, B in
 * [2, COMM_MAX_RANKS] and A below it. */
static bool folder_named(DIR *d, const char *name, const char *what, int *a, int *b)
{
    char fmt[32];
    int end = 0;
    struct stat st;
    snprintf(fmt, sizeof(fmt), "%s-%%d-of-%%d%%n", what);
    if (sscanf(name, fmt, a, b, &end) != 2 || name[end] || *b < 2 || *b > COMM_MAX_RANKS ||
        *a < 0 || *a >= *b)
        return false;
    return fstatat(dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
}

static void add_layout(struct layout *l, int *n, int P, int N)
{
    for (int k = 0; k < *n; k++)
        if (l[k].P == P && l[k].N == N) return;
    if (*n < MAX_LAYOUTS) l[(*n)++] = (struct layout){P, N};
}

/* Every layout whose folders appear under root (one rank's is the path itself): rank-R-of-N,
 * stage-S-of-P, stage-S-of-P/rank-R-of-N. Whether they hold a run is not looked at. */
static int layouts_under(const char *root, struct layout *l)
{
    int n = 0, a, b, x, y;
    add_layout(l, &n, 1, 1);
    DIR *d = opendir(root);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (folder_named(d, de->d_name, "rank", &a, &b)) {
            add_layout(l, &n, 1, b);
            continue;
        }
        if (!folder_named(d, de->d_name, "stage", &a, &b)) continue;
        add_layout(l, &n, b, 1);
        int fd = openat(dirfd(d), de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        DIR *sd = fd >= 0 ? fdopendir(fd) : NULL;
        if (!sd && fd >= 0) close(fd);
        struct dirent *se;
        while (sd && (se = readdir(sd)))
            if (folder_named(sd, se->d_name, "rank", &x, &y)) add_layout(l, &n, b, y);
        if (sd) closedir(sd);
    }
    if (d) closedir(d);
    return n;
}

/* ---- the run a resume goes to -------------------------------------------------------- */

/* The newest step that every folder of layout P x N under the first path holds, as its
 * current version or the previous one (a checkpoint that some ranks committed and others
 * did not); -1 when some folder holds none of the others' (or nothing), -2 for a run saved
 * before checkpoints were tagged with their step (every folder's manifest untagged).
 * *newest: the newest step any folder holds; *held: how many hold a saved run; *miss: the
 * first that holds none (-1: none). This run's own layout without a pipeline takes what
 * each rank saw in its own folder (peer_saved: across nodes, rank 0 cannot read them). */
static int64_t common_step(const struct trainer *t, int P, int N, int64_t *newest, int *held,
                           int *miss)
{
    int64_t tags[COMM_MAX_RANKS][2];
    int untagged = 0, F = P * N;
    bool peers = P == 1 && t->pp == 1 && N == t->world && t->peer_saved;
    *newest = -1;
    *held = 0;
    *miss = -1;
    for (int f = 0; f < F; f++) {
        int r;
        if (peers) {
            r = (int)t->peer_saved[f][0];
            tags[f][0] = t->peer_saved[f][1];
            tags[f][1] = t->peer_saved[f][2];
        } else {
            char *d = train_layout_dir(train_root(t, 0), P, N, f / N, f % N);
            r = d ? zinf_saved_steps(d, tags[f]) : -ENOMEM;
            free(d);
        }
        if (r < 0) {
            if (*miss < 0) *miss = f;
            continue;
        }
        ++*held;
        untagged += tags[f][0] < 0;
        *newest = MAX(*newest, tags[f][0]);
    }
    if (*held < F) return -1;
    if (untagged) return untagged == F ? -2 : -1;
    int64_t best = -1;
    for (int f = 0; f < F; f++)
        for (int k = 0; k < 2; k++) {
            int64_t c = tags[f][k];
            if (c <= best) continue;
            bool all = true;
            for (int p = 0; p < F && all; p++)
                all = tags[p][0] == c || tags[p][1] == c;
            if (all) best = c;
        }
    return best;
}

/* The run to resume from, of those saved under the nvme paths in any layout: its layout
 * (P 0: none) and the step every one of its folders saved (-1 for a run saved before steps
 * were tagged). A layout that some folder holds nothing of (a stage's folder removed), or
 * whose folders hold no step in common (a re-cut cut short), is passed over, and said in
 * bad_* (this run's own layout first). The run with the newest such step wins; on a tie,
 * this run's layout, then the newest. Runs saved before steps were tagged count only where
 * no other run is known, the newest of them winning. */
int train_newest_run(const struct trainer *t, struct train_saved *out)
{
    struct layout l[MAX_LAYOUTS], legacy = {0, 0};
    int64_t best_t = 0, legacy_t = 0, when; /* ns since the epoch */
    *out = (struct train_saved){.step = -1, .newest = -1, .bad_f = -1};
    if (!t->nbase) return 0;
    int nl = layouts_under(train_root(t, 0), l);
    for (int k = 0; k < nl; k++) {
        int P = l[k].P, N = l[k].N, held, miss;
        bool own = P == t->pp && N == t->world;
        if (P * N > COMM_MAX_RANKS) continue; /* no launch makes it */
        int64_t top, c = common_step(t, P, N, &top, &held, &miss);
        if (!held) continue;
        if (c == -1) { /* held in part, or with no step in common */
            if (!out->bad_P || own) {
                out->bad_P = P;
                out->bad_N = N;
                out->bad_f = miss;
            }
            continue;
        }
        char *r0 = train_layout_dir(train_root(t, 0), P, N, 0, 0);
        int sr = r0 ? zinf_saved_at(r0, &when) : -ENOMEM;
        free(r0);
        if (sr < 0) continue;
        if (c == -2) { /* untagged: by its time, as before tags */
            if (!legacy.P || when > legacy_t) {
                legacy = l[k];
                legacy_t = when;
            }
            continue;
        }
        bool best_own = out->P == t->pp && out->N == t->world;
        if (!out->P || c > out->step || (c == out->step && !best_own && (own || when > best_t))) {
            out->P = P;
            out->N = N;
            out->step = c;
            out->newest = top;
            best_t = when;
        }
    }
    if (!out->P && legacy.P) {
        out->P = legacy.P;
        out->N = legacy.N;
        out->step = out->newest = -1;
    }
    return out->P;
}

int train_gather_saved(struct trainer *t)
{
    int64_t mine[3] = {-ENOENT, -1, -1};
    if (t->world <= 1 || t->remote || !t->nbase) return 0;
    if (!t->peer_saved && !(t->peer_saved = calloc((size_t)t->world, sizeof(*t->peer_saved))))
        return -ENOMEM;
    mine[0] = zinf_saved_steps(t->zc.nvme_paths.path[0], mine + 1);
    return comm_allgather(t->hcomm, mine, t->peer_saved, sizeof(mine), COMM_BYTE);
}

/* ---- --overwrite ---------------------------------------------------------------------- */

/* Folder f of layout P x N's share of a saved run, removed from every nvme path: its
 * manifests and swap files (zinf_saved_remove, which touches nothing else), then its
 * rank-R-of-N folders where that left them empty. *had: whether it held a saved state. */
static int remove_share(struct trainer *t, int P, int N, int f, bool *had)
{
    char *dirs[CONFIG_MAX_NVME_PATHS + 1] = {0}; /* NULL-terminated */
    int r = 0;
    size_t n;
    for (unsigned k = 0; k < t->nbase && r == 0; k++)
        if (!(dirs[k] = train_layout_dir(train_root(t, k), P, N, f / N, f % N))) r = -ENOMEM;
    if (r == 0) {
        *had = zinf_saved_tensors(dirs[0], &n) == 0;
        r = zinf_saved_remove(dirs[0], (const char *const *)dirs + 1);
    }
    for (unsigned k = 0; k < t->nbase; k++) {
        if (r == 0 && N > 1) rmdir(dirs[k]); /* only where nothing else is left */
        free(dirs[k]);
    }
    return r;
}

/* Where a layout's folders are under root, for the notices: "", "/rank-*-of-N"... */
static void layout_glob(int P, int N, char *buf, size_t len)
{
    char st[32] = "", rk[32] = "";
    if (P > 1) snprintf(st, sizeof(st), "/stage-*-of-%d", P);
    if (N > 1) snprintf(rk, sizeof(rk), "/rank-*-of-%d", N);
    snprintf(buf, len, "%s%s", st, rk);
}

/* --overwrite starts over the whole swap path, not only this run's share of it: a run saved
 * there in another layout would otherwise stay, and a later --resume, going to the newest
 * step saved, would continue that one instead of the new run. This run's own folders the
 * engines start over; here go the folders of every other layout (the paths themselves,
 * rank-R-of-N, stage-S-of-P and the rank folders in those). Only zinf's files of those runs
 * are removed, and their folders once empty (never this run's stages' folders, which its
 * other stages are opening); one rank does it, before its engine opens, each run it removes
 * said. */
int train_remove_other_runs(struct trainer *t, char *err, size_t errlen)
{
    struct layout l[MAX_LAYOUTS];
    int r = 0, failed = -1;
    if (!t->nbase) return 0;
    int nl = layouts_under(train_root(t, 0), l);
    for (int k = 0; k < nl && r == 0; k++) {
        int P = l[k].P, N = l[k].N;
        bool had = false, one;
        if (P == t->pp && N == t->world) continue;
        for (int f = 0; f < P * N && r == 0; f++) {
            one = false;
            r = remove_share(t, P, N, f, &one);
            had |= one;
        }
        if (r < 0) failed = k;
        char name[64], glob[64];
        if (had && r == 0) {
            layout_glob(P, N, glob, sizeof(glob));
            log_notice("--overwrite: removed the run saved by %s in %s%s",
                       train_layout_name(P, N, name, sizeof(name)), train_root(t, 0), glob);
        }
    }
    /* The stage folders of other numbers of stages, where that left them empty. */
    for (int k = 0; k < nl && r == 0; k++)
        for (int s = 0; s < l[k].P && l[k].P > 1 && l[k].P != t->pp; s++)
            for (unsigned j = 0; j < t->nbase; j++) {
                char *d = train_layout_dir(train_root(t, j), l[k].P, 1, s, 0);
                if (d) rmdir(d);
                free(d);
            }
    char name[64];
    if (r < 0 && failed >= 0)
        snprintf(err, errlen, "--overwrite: cannot remove the run saved by %s in %s: %s",
                 train_layout_name(l[failed].P, l[failed].N, name, sizeof(name)),
                 train_root(t, 0),
                 r == -EBUSY    ? "its swap files are in use by another engine (one job per "
                                  "swap directory)"
                 : r == -EACCES ? "one of its swap files or manifests is not this user's "
                                  "regular file; remove it by hand"
                                : zinf_strerror(r));
    return r;
}

/* ---- what trainer_open makes of it ---------------------------------------------------- */

/* "--resume: no step is saved by every one of the 2 ranks under DIR: rank 0 holds step 4,
 * rank 1 holds step 2", as each folder's manifests say. */
static void say_split(const struct trainer *t, int P, int N, char *err, size_t errlen)
{
    char name[64], who[48];
    int k = snprintf(err, errlen, "--resume: no step is saved by every one of the %s under %s:",
                     train_layout_name(P, N, name, sizeof(name)), train_root(t, 0));
    for (int f = 0; f < P * N && k > 0 && (size_t)k < errlen; f++) {
        int64_t tags[2] = {-1, -1};
        char *rd = train_layout_dir(train_root(t, 0), P, N, f / N, f % N);
        if (rd) zinf_saved_steps(rd, tags);
        free(rd);
        char held[64] = "no step";
        if (tags[0] >= 0 && tags[1] >= 0)
            snprintf(held, sizeof(held), "steps %lld and %lld", (long long)tags[0],
                     (long long)tags[1]);
        else if (tags[0] >= 0)
            snprintf(held, sizeof(held), "step %lld", (long long)tags[0]);
        k += snprintf(err + k, errlen - (size_t)k, "%s %s holds %s", f ? "," : "",
                      train_folder_name(P, N, f, who, sizeof(who)), held);
    }
}

/* The saved run found by the first rank of the first stage, for every rank: over the stages
 * of each copy of a pipeline, then over each stage's copies (or the ranks). */
static int agree(struct trainer *t, struct train_saved *f)
{
    int r = t->pp == 1 ? train_gather_saved(t) : 0;
    if (r == 0 && t->rank == 0 && t->ps == 0) train_newest_run(t, f);
    if (r == 0 && t->pp > 1) r = train_pipe_bcast(t, f, sizeof(*f));
    if (r == 0 && t->world > 1) r = comm_broadcast(t->hcomm, f, sizeof(*f), COMM_BYTE, 0);
    return r;
}

int train_find_saved(struct trainer *t, char *err, size_t errlen)
{
    const struct trainer_opts *o = &t->o;
    bool resume = o->resume; /* a re-cut clears o->resume: its tensors are new */
    const char *sd = t->zc.nvme_paths.path[0], *root = train_root(t, 0);
    struct train_saved f = {.step = -1, .newest = -1, .bad_f = -1};
    char name[64], where[64];
    size_t n = 0;
    int pr = zinf_saved_tensors(sd, &n), r;
    if ((r = agree(t, &f)) < 0) {
        snprintf(err, errlen, "rank %d: the ranks could not agree on the saved run: %s",
                 t->pp > 1 ? o->rank : t->rank, zinf_strerror(r));
        return r;
    }
    t->resume_step = f.step;
    bool other = f.P && (f.P != t->pp || f.N != t->world);
    if (resume && f.P && t->rank == 0 && t->ps == 0 && f.newest > f.step && f.step >= 0)
        log_notice("--resume: rolling back %lld step%s to step %lld, the newest that every "
                   "one of the %s saved: the checkpoint of step %lld was not completed by "
                   "every one",
                   (long long)(f.newest - f.step), f.newest - f.step == 1 ? "" : "s",
                   (long long)f.step, train_layout_name(f.P, f.N, name, sizeof(name)),
                   (long long)f.newest);
    if (resume && !f.P && f.bad_P && f.bad_f < 0) {
        say_split(t, f.bad_P, f.bad_N, err, errlen);
        return -EINVAL;
    }
    if (resume && !f.P && f.bad_P) {
        char *d = train_layout_dir(root, f.bad_P, f.bad_N, f.bad_f / f.bad_N, f.bad_f % f.bad_N);
        snprintf(err, errlen,
                 "--resume: the saved run of %s in %s is not whole: %s (%s) holds no saved "
                 "run; restore it, or start over with --overwrite",
                 train_layout_name(f.bad_P, f.bad_N, name, sizeof(name)), root,
                 train_folder_name(f.bad_P, f.bad_N, f.bad_f, where, sizeof(where)),
                 d ? d : "?");
        free(d);
        return -ENOENT;
    }
    if (resume && other) {
        t->src_pp = f.P;
        t->src_world = f.N;
        t->o.resume = false; /* this rank's tensors are new, filled by train_recut() */
        if ((r = train_recut_check(t, err, errlen)) < 0) return r;
    } else if (resume && pr == -ENOENT) {
        char mp[NAME_MAX + 1];
        if (other_parallel(t, mp, sizeof(mp)))
            snprintf(err, errlen,
                     "--resume: no saved run in %s, but %s holds %s, the folder of a run saved "
                     "by other tensor- or sequence-parallel ranks: resuming onto another such "
                     "layout is not built yet (resume with the layout that saved it)",
                     sd, train_root(t, 0), mp);
        else
            snprintf(err, errlen, "--resume: no saved run in %s", sd);
        return -ENOENT;
    }
    /* Another layout's run, whole or in part, is a saved run as this one's own is. */
    int P = other ? f.P : f.bad_P, N = other ? f.N : f.bad_N;
    bool theirs = P && (P != t->pp || N != t->world);
    if (!resume && !o->overwrite && ((pr == 0 && n > 0) || theirs)) {
        char by[96] = "";
        if (theirs)
            snprintf(by, sizeof(by), " (by %s%s)", train_layout_name(P, N, name, sizeof(name)),
                     other ? "" : ", not whole");
        snprintf(err, errlen, "%s holds a saved run%s: %s, or start over with --overwrite "
                              "(which deletes it)",
                 theirs ? root : sd, by,
                 theirs && !other ? "restore its missing folders and continue it with --resume"
                                  : "continue it with --resume");
        return -EEXIST;
    }
    if (o->overwrite && t->rank == 0 && t->ps == 0 &&
        (r = train_remove_other_runs(t, err, errlen)) < 0)
        return r;
    return 0;
}
