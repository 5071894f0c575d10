/*
 * trainer_layouts.c - the saved runs a swap path holds, in every layout a run can have
 * (struct train_lay): P pipeline stages x T tensor- or S sequence-parallel ranks x N ranks
 * (copies) each (1 where unused), each rank keeping its swap files under each nvme path in
 * [stage-S-of-P][.|/][tp-J-of-T|sp-J-of-S][/rank-R-of-N] (one rank: the path itself). Here:
 * those folders and their names, the choice of the run a resume goes to (the newest step
 * saved whole by every folder of its layout), what trainer_open makes of it (resume, re-cut,
 * refuse a new run over it), and the removal of the other layouts' runs that --overwrite
 * asks for.
 *
 * Not here: the saved state's checks (trainer_resume.c), the re-cut itself
 * (trainer_recut.c), the folders of this run's own stage and rank (trainer_pipe.c,
 * trainer_shards.c).
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

struct train_lay train_own_layout(const struct trainer *t)
{
    return (struct train_lay){MAX(1, t->pp), MAX(1, t->tp), MAX(1, t->sp), MAX(1, t->world)};
}

bool train_lay_same(const struct train_lay *a, const struct train_lay *b)
{
    return a->P == b->P && a->T == b->T && a->S == b->S && a->N == b->N;
}

/* The folders a layout has: stages x tp or sp ranks x copies. */
static int folders(const struct train_lay *l)
{
    return l->P * l->T * l->S * l->N;
}

char *train_layout_dir(const char *root, const struct train_lay *l, int f)
{
    int I = l->T * l->S, s = f / (I * l->N), j = f / l->N % I, q = f % l->N, n;
    const char *kind = l->T > 1 ? "tp" : "sp";
    char grp[96] = "", rk[48] = "", *d = NULL;
    if (l->P > 1 && I > 1)
        snprintf(grp, sizeof(grp), "/stage-%d-of-%d.%s-%d-of-%d", s, l->P, kind, j, I);
    else if (l->P > 1)
        snprintf(grp, sizeof(grp), "/stage-%d-of-%d", s, l->P);
    else if (I > 1)
        snprintf(grp, sizeof(grp), "/%s-%d-of-%d", kind, j, I);
    if (l->N > 1) snprintf(rk, sizeof(rk), "/rank-%d-of-%d", q, l->N);
    n = asprintf(&d, "%s%s%s", root, grp, rk);
    return n < 0 ? NULL : d;
}

const char *train_layout_name(const struct train_lay *l, char *buf, size_t len)
{
    int I = l->T * l->S, k = 0;
    buf[0] = '\0';
    if (l->P > 1) k += snprintf(buf + k, len - (size_t)k, "%d pipeline stages", l->P);
    if (I > 1 && (size_t)k < len)
        k += snprintf(buf + k, len - (size_t)k, "%s%d %s-parallel ranks", k ? " x " : "", I,
                      l->T > 1 ? "tensor" : "sequence");
    if (l->N > 1 && (size_t)k < len)
        k += snprintf(buf + k, len - (size_t)k, "%s%d %s", k ? " x " : "", l->N,
                      I > 1 ? "copies" : "ranks");
    if (!k) snprintf(buf, len, "one rank");
    return buf;
}

const char *train_folder_name(const struct train_lay *l, int f, char *buf, size_t len)
{
    int I = l->T * l->S, k = 0;
    buf[0] = '\0';
    if (l->P > 1) k += snprintf(buf + k, len - (size_t)k, "stage %d", f / (I * l->N));
    if (I > 1 && (size_t)k < len)
        k += snprintf(buf + k, len - (size_t)k, "%s%s rank %d", k ? " " : "",
                      l->T > 1 ? "tp" : "sp", f / l->N % I);
    if ((l->N > 1 || !k) && (size_t)k < len)
        snprintf(buf + k, len - (size_t)k, "%s%s %d", k ? " " : "", I > 1 ? "copy" : "rank",
                 f % l->N);
    return buf;
}

/* ---- the layouts under a path ------------------------------------------------------- */

/* Whether s begins WHAT-A-of-B, B in [2, COMM_MAX_RANKS] and A below it; *n: its length. */
static bool part(const char *s, const char *what, int *b, int *n)
{
    char fmt[32];
    int a;
    *n = 0;
    snprintf(fmt, sizeof(fmt), "%s-%%d-of-%%d%%n", what);
    return sscanf(s, fmt, &a, b, n) == 2 && *n > 0 && *b >= 2 && *b <= COMM_MAX_RANKS && a >= 0 &&
           a < *b;
}

/* Whether entry `name` of d is a folder, not a link to one. */
static bool is_folder(DIR *d, const char *name)
{
    struct stat st;
    return fstatat(dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
}

/* Whether entry `name` of d is the folder of a layout's stage or tp or sp rank:
 * stage-S-of-P, tp-J-of-T, sp-J-of-S, stage-S-of-P.tp-J-of-T, stage-S-of-P.sp-J-of-S; g
 * its P, T and S (N 1). */
static bool group_named(DIR *d, const char *name, struct train_lay *g)
{
    const char *p = name;
    int b, n;
    *g = (struct train_lay){1, 1, 1, 1};
    if (part(p, "stage", &b, &n)) {
        g->P = b;
        p += n;
        if (!*p) return is_folder(d, name);
        if (*p++ != '.') return false;
    }
    if (part(p, "tp", &b, &n))
        g->T = b;
    else if (part(p, "sp", &b, &n))
        g->S = b;
    else
        return false;
    return !p[n] && is_folder(d, name);
}

static void add_layout(struct train_lay *l, int *n, struct train_lay x)
{
    for (int k = 0; k < *n; k++)
        if (train_lay_same(&l[k], &x)) return;
    if (*n < MAX_LAYOUTS) l[(*n)++] = x;
}

/* Every layout whose folders appear under root (one rank's is the path itself): rank-R-of-N,
 * the stage, tp and sp folders (group_named) and the rank-R-of-N in those. Whether they hold
 * a run is not looked at. */
static int layouts_under(const char *root, struct train_lay *l)
{
    int n = 0, b, y, m;
    struct train_lay g;
    add_layout(l, &n, (struct train_lay){1, 1, 1, 1});
    DIR *d = opendir(root);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (part(de->d_name, "rank", &b, &m) && !de->d_name[m] && is_folder(d, de->d_name)) {
            add_layout(l, &n, (struct train_lay){1, 1, 1, b});
            continue;
        }
        if (!group_named(d, de->d_name, &g)) continue;
        add_layout(l, &n, g);
        int fd = openat(dirfd(d), de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        DIR *sd = fd >= 0 ? fdopendir(fd) : NULL;
        if (!sd && fd >= 0) close(fd);
        struct dirent *se;
        while (sd && (se = readdir(sd)))
            if (part(se->d_name, "rank", &y, &m) && !se->d_name[m] && is_folder(sd, se->d_name))
                add_layout(l, &n, (struct train_lay){g.P, g.T, g.S, y});
        if (sd) closedir(sd);
    }
    if (d) closedir(d);
    return n;
}

/* ---- the run a resume goes to -------------------------------------------------------- */

/* The newest step that every folder of layout l under the first path holds, as its
 * current version or the previous one (a checkpoint that some ranks committed and others
 * did not); -1 when some folder holds none of the others' (or nothing), -2 for a run saved
 * before checkpoints were tagged with their step (every folder's manifest untagged).
 * *newest: the newest step any folder holds; *held: how many hold a saved run; *miss: the
 * first that holds none (-1: none). This run's own layout of ranks alone (no stages, no tp
 * or sp) takes what each rank saw in its own folder (peer_saved: across nodes, rank 0
 * cannot read them). */
static int64_t common_step(const struct trainer *t, const struct train_lay *l, int64_t *newest,
                           int *held, int *miss)
{
    int64_t tags[COMM_MAX_RANKS][2];
    int untagged = 0, F = folders(l);
    struct train_lay mine = train_own_layout(t);
    bool peers = l->P == 1 && l->T * l->S == 1 && train_lay_same(l, &mine) && t->peer_saved;
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
            char *d = train_layout_dir(train_root(t, 0), l, f);
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
 * bad* (this run's own layout first). The run with the newest such step wins; on a tie,
 * this run's layout, then the newest. Runs saved before steps were tagged count only where
 * no other run is known, the newest of them winning. */
int train_newest_run(const struct trainer *t, struct train_saved *out)
{
    struct train_lay l[MAX_LAYOUTS], legacy = {0}, mine = train_own_layout(t);
    int64_t best_t = 0, legacy_t = 0, when; /* ns since the epoch */
    *out = (struct train_saved){.step = -1, .newest = -1, .bad_f = -1};
    if (!t->nbase) return 0;
    int nl = layouts_under(train_root(t, 0), l);
    for (int k = 0; k < nl; k++) {
        int held, miss;
        bool own = train_lay_same(&l[k], &mine);
        if (folders(&l[k]) > COMM_MAX_RANKS) continue; /* no launch makes it */
        int64_t top, c = common_step(t, &l[k], &top, &held, &miss);
        if (!held) continue;
        if (c == -1) { /* held in part, or with no step in common */
            if (!out->bad.P || own) {
                out->bad = l[k];
                out->bad_f = miss;
            }
            continue;
        }
        char *r0 = train_layout_dir(train_root(t, 0), &l[k], 0);
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
        bool best_own = train_lay_same(&out->lay, &mine);
        if (!out->lay.P || c > out->step ||
            (c == out->step && !best_own && (own || when > best_t))) {
            out->lay = l[k];
            out->step = c;
            out->newest = top;
            best_t = when;
        }
    }
    if (!out->lay.P && legacy.P) {
        out->lay = legacy;
        out->step = out->newest = -1;
    }
    return out->lay.P;
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

/* Folder f of layout l's share of a saved run, removed from every nvme path: its manifests
 * and swap files (zinf_saved_remove, which touches nothing else), then its rank-R-of-N
 * folders where that left them empty. *had: whether it held a saved state. */
static int remove_share(struct trainer *t, const struct train_lay *l, int f, bool *had)
{
    char *dirs[CONFIG_MAX_NVME_PATHS + 1] = {0}; /* NULL-terminated */
    int r = 0;
    size_t n;
    for (unsigned k = 0; k < t->nbase && r == 0; k++)
        if (!(dirs[k] = train_layout_dir(train_root(t, k), l, f))) r = -ENOMEM;
    if (r == 0) {
        *had = zinf_saved_tensors(dirs[0], &n) == 0;
        r = zinf_saved_remove(dirs[0], (const char *const *)dirs + 1);
    }
    for (unsigned k = 0; k < t->nbase; k++) {
        if (r == 0 && l->N > 1) rmdir(dirs[k]); /* only where nothing else is left */
        free(dirs[k]);
    }
    return r;
}

/* Where a layout's folders are under root, for the notices: "", "/rank-*-of-N",
 * "/stage-*-of-P.tp-*-of-T"... */
static void layout_glob(const struct train_lay *l, char *buf, size_t len)
{
    char st[32] = "", in[32] = "", rk[32] = "";
    int I = l->T * l->S;
    if (l->P > 1) snprintf(st, sizeof(st), "/stage-*-of-%d", l->P);
    if (I > 1)
        snprintf(in, sizeof(in), "%s%s-*-of-%d", l->P > 1 ? "." : "/", l->T > 1 ? "tp" : "sp",
                 I);
    if (l->N > 1) snprintf(rk, sizeof(rk), "/rank-*-of-%d", l->N);
    snprintf(buf, len, "%s%s%s", st, in, rk);
}

/* --overwrite starts over the whole swap path, not only this run's share of it: a run saved
 * there in another layout would otherwise stay, and a later --resume, going to the newest
 * step saved, would continue that one instead of the new run. This run's own folders the
 * engines start over; here go the folders of every other layout (the paths themselves,
 * rank-R-of-N, the stage, tp and sp folders and the rank folders in those). Only zinf's
 * files of those runs are removed, and their folders once empty (never the folders this
 * run's stages and tp or sp ranks are opening); one rank does it, before its engine opens,
 * each run it removes said. */
int train_remove_other_runs(struct trainer *t, char *err, size_t errlen)
{
    struct train_lay l[MAX_LAYOUTS], mine = train_own_layout(t);
    int r = 0, failed = -1;
    if (!t->nbase) return 0;
    int nl = layouts_under(train_root(t, 0), l);
    for (int k = 0; k < nl && r == 0; k++) {
        bool had = false, one;
        if (train_lay_same(&l[k], &mine) || folders(&l[k]) > COMM_MAX_RANKS) continue;
        for (int f = 0; f < folders(&l[k]) && r == 0; f++) {
            one = false;
            r = remove_share(t, &l[k], f, &one);
            had |= one;
        }
        if (r < 0) failed = k;
        char name[96], glob[96];
        if (had && r == 0) {
            layout_glob(&l[k], glob, sizeof(glob));
            log_notice("--overwrite: removed the run saved by %s in %s%s",
                       train_layout_name(&l[k], name, sizeof(name)), train_root(t, 0), glob);
        }
    }
    /* The stage, tp and sp folders of other layouts than this run's, where that left them
     * empty. */
    for (int k = 0; k < nl && r == 0; k++) {
        struct train_lay g = {l[k].P, l[k].T, l[k].S, 1};
        int G = folders(&g);
        if (G == 1 || (g.P == mine.P && g.T == mine.T && g.S == mine.S)) continue;
        for (int f = 0; f < G; f++)
            for (unsigned j = 0; j < t->nbase; j++) {
                char *d = train_layout_dir(train_root(t, j), &g, f);
                if (d) rmdir(d);
                free(d);
            }
    }
    char name[96];
    if (r < 0 && failed >= 0)
        snprintf(err, errlen, "--overwrite: cannot remove the run saved by %s in %s: %s",
                 train_layout_name(&l[failed], name, sizeof(name)), train_root(t, 0),
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
static void say_split(const struct trainer *t, const struct train_lay *l, char *err,
                      size_t errlen)
{
    char name[96], who[64];
    int k = snprintf(err, errlen, "--resume: no step is saved by every one of the %s under %s:",
                     train_layout_name(l, name, sizeof(name)), train_root(t, 0));
    for (int f = 0; f < folders(l) && k > 0 && (size_t)k < errlen; f++) {
        int64_t tags[2] = {-1, -1};
        char *rd = train_layout_dir(train_root(t, 0), l, f);
        if (rd) zinf_saved_steps(rd, tags);
        free(rd);
        char held[64] = "no step";
        if (tags[0] >= 0 && tags[1] >= 0)
            snprintf(held, sizeof(held), "steps %lld and %lld", (long long)tags[0],
                     (long long)tags[1]);
        else if (tags[0] >= 0)
            snprintf(held, sizeof(held), "step %lld", (long long)tags[0]);
        k += snprintf(err + k, errlen - (size_t)k, "%s %s holds %s", f ? "," : "",
                      train_folder_name(l, f, who, sizeof(who)), held);
    }
}

/* Whether this rank is the first of the run: copy 0, stage 0, tp or sp rank 0. */
static bool first_rank(const struct trainer *t)
{
    return t->rank == 0 && t->ps == 0 && t->tr == 0 && t->sq == 0;
}

/* The saved run found by the first rank, for every rank: over the stages of each copy of a
 * pipeline (each tp or sp rank's stages), then over each stage's tp or sp ranks, then over
 * each stage's copies (or the ranks). */
static int agree(struct trainer *t, struct train_saved *f)
{
    int r = t->pp == 1 ? train_gather_saved(t) : 0;
    if (r == 0 && first_rank(t)) train_newest_run(t, f);
    if (r == 0 && t->pp > 1) r = train_pipe_bcast(t, f, sizeof(*f));
    if (r == 0 && t->tp * t->sp > 1) r = train_group_bcast(t, f, sizeof(*f));
    if (r == 0 && t->world > 1) r = comm_broadcast(t->hcomm, f, sizeof(*f), COMM_BYTE, 0);
    return r;
}

int train_find_saved(struct trainer *t, char *err, size_t errlen)
{
    const struct trainer_opts *o = &t->o;
    bool resume = o->resume; /* a re-cut clears o->resume: its tensors are new */
    const char *sd = t->zc.nvme_paths.path[0], *root = train_root(t, 0);
    struct train_saved f = {.step = -1, .newest = -1, .bad_f = -1};
    struct train_lay mine = train_own_layout(t);
    char name[96], where[64];
    size_t n = 0;
    int pr = zinf_saved_tensors(sd, &n), r;
    if ((r = agree(t, &f)) < 0) {
        snprintf(err, errlen, "rank %d: the ranks could not agree on the saved run: %s",
                 t->mp ? o->rank : t->rank, zinf_strerror(r));
        return r;
    }
    t->resume_step = f.step;
    bool other = f.lay.P && !train_lay_same(&f.lay, &mine);
    if (resume && f.lay.P && first_rank(t) && f.newest > f.step && f.step >= 0)
        log_notice("--resume: rolling back %lld step%s to step %lld, the newest that every "
                   "one of the %s saved: the checkpoint of step %lld was not completed by "
                   "every one",
                   (long long)(f.newest - f.step), f.newest - f.step == 1 ? "" : "s",
                   (long long)f.step, train_layout_name(&f.lay, name, sizeof(name)),
                   (long long)f.newest);
    if (resume && !f.lay.P && f.bad.P && f.bad_f < 0) {
        say_split(t, &f.bad, err, errlen);
        return -EINVAL;
    }
    if (resume && !f.lay.P && f.bad.P) {
        char *d = train_layout_dir(root, &f.bad, f.bad_f);
        snprintf(err, errlen,
                 "--resume: the saved run of %s in %s is not whole: %s (%s) holds no saved "
                 "run; restore it, or start over with --overwrite",
                 train_layout_name(&f.bad, name, sizeof(name)), root,
                 train_folder_name(&f.bad, f.bad_f, where, sizeof(where)), d ? d : "?");
        free(d);
        return -ENOENT;
    }
    if (resume && other) {
        t->src = f.lay;
        t->o.resume = false; /* this rank's tensors are new, filled by train_recut() */
        if ((r = train_recut_check(t, err, errlen)) < 0) return r;
    } else if (resume && pr == -ENOENT) {
        snprintf(err, errlen, "--resume: no saved run in %s", sd);
        return -ENOENT;
    }
    /* Another layout's run, whole or in part, is a saved run as this one's own is. */
    struct train_lay *L = other ? &f.lay : &f.bad;
    bool theirs = L->P && !train_lay_same(L, &mine);
    if (!resume && !o->overwrite && ((pr == 0 && n > 0) || theirs)) {
        char by[128] = "";
        if (theirs)
            snprintf(by, sizeof(by), " (by %s%s)", train_layout_name(L, name, sizeof(name)),
                     other ? "" : ", not whole");
        snprintf(err, errlen, "%s holds a saved run%s: %s, or start over with --overwrite "
                              "(which deletes it)",
                 theirs ? root : sd, by,
                 theirs && !other ? "restore its missing folders and continue it with --resume"
                                  : "continue it with --resume");
        return -EEXIST;
    }
    if (o->overwrite && first_rank(t) && (r = train_remove_other_runs(t, err, errlen)) < 0)
        return r;
    return 0;
}
