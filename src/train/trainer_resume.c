/*
 * trainer_resume.c - what a run saves and how it comes back: the state tensor (the model,
 * the data and the step) saved and validated, a checkpoint (saved by every rank or by
 * none: each keeps its previous version until all hold the new one), the choice of the
 * run and step a resume goes to, and the re-cut of a run saved by another number of ranks
 * into this run's shards. The tests' crash points are here too.
 *
 * Not here: opening the engine (trainer.c), registering the tensors (trainer_tensors.c),
 * the shards' geometry (trainer_shards.c).
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
#include "train/backend.h"
#include "train/trainer_impl.h"
#include "trace.h"

/* The saved state s, of a run of src_world ranks, against this run: the same model, data,
 * precision and global batch (micro-batches x ranks). */
static int state_validate(struct trainer *t, struct train_state s, int src_world, char *err,
                          size_t errlen)
{
    int accum = s.accum ? s.accum : 1;
    if (s.magic == STATE_MAGIC_V2) {
        s.held_out = 0; /* that version trained on the whole file: so does its resume */
        t->train_bytes = t->data_bytes;
    } else if (s.magic != STATE_MAGIC) {
        snprintf(err, errlen,
                 "--resume: the state in the swap directory was written by another "
                 "version of zinf train; start a new run");
        return -EINVAL;
    }
    if (s.L != t->cfg.L || s.C != t->cfg.C || s.NH != t->cfg.NH || s.maxT != t->cfg.maxT ||
        s.B != t->o.batch || s.T != t->o.seq || s.seed != t->o.seed ||
        s.data_bytes != t->data_bytes || s.wdt != (int32_t)t->be->wdt ||
        (int64_t)accum * src_world != (int64_t)t->o.grad_accum * t->world) {
        int64_t total = (int64_t)accum * src_world;
        char ranks[256] = "";
        if (src_world != t->world)
            snprintf(ranks, sizeof(ranks),
                     " (by %d ranks: %lld micro-batches a step, which %d ranks run as "
                     "--accumulate %lld%s)",
                     src_world, (long long)total, t->world, (long long)(total / t->world),
                     total % t->world ? ", not a whole number: choose another number of ranks"
                                      : "");
        snprintf(err, errlen,
                 "--resume: the saved run used --layers %d --dim %d --heads %d "
                 "--seq %d --batch %d --accumulate %d --seed %llu --precision %s on %llu bytes "
                 "of data%s; give the same",
                 s.L, s.C, s.NH, s.T, s.B, accum, (unsigned long long)s.seed,
                 s.wdt == BACKEND_BF16  ? "bf16"
                 : s.wdt == BACKEND_F16 ? "fp16"
                                        : "fp32",
                 (unsigned long long)s.data_bytes, ranks);
        return -EINVAL;
    }
    if (s.magic == STATE_MAGIC && (s.held_out != 0) != (t->train_bytes < t->data_bytes)) {
        snprintf(err, errlen,
                 "--resume: the saved run %s the last tenth of the data for "
                 "validation, this one would not: give the same data",
                 s.held_out ? "held out" : "did not hold out");
        return -EINVAL;
    }
    t->state_v2 = s.magic == STATE_MAGIC_V2;
    t->step_done = s.step_done;
    return 0;
}

int train_state_check(struct trainer *t, char *err, size_t errlen)
{
    struct train_state s;
    int r = zinf_read(t->e, t->state, 0, &s, sizeof(s));
    if (r < 0) return r;
    return state_validate(t, s, t->world, err, errlen);
}

int train_state_save_step(struct trainer *t, int step_done)
{
    struct train_state s = {.magic = STATE_MAGIC,
                            .step_done = step_done,
                            .L = t->cfg.L,
                            .C = t->cfg.C,
                            .NH = t->cfg.NH,
                            .maxT = t->cfg.maxT,
                            .B = t->o.batch,
                            .T = t->o.seq,
                            .seed = t->o.seed,
                            .data_bytes = t->data_bytes,
                            .wdt = (int32_t)t->be->wdt,
                            .accum = t->o.grad_accum,
                            .held_out = t->train_bytes < t->data_bytes};
    if (t->state_v2) {
        /* A run resumed from the earlier layout keeps it, so that a later resume agrees. */
        s.magic = STATE_MAGIC_V2;
        s.held_out = 0;
    }
    return zinf_write(t->e, t->state, 0, &s, sizeof(s));
}

static int state_save(struct trainer *t)
{
    return train_state_save_step(t, t->step_done);
}

/* Several ranks (zinf launch): check what this version partitions (the CPU backend, fp32,
 * each rank an engine of its own), give each rank a swap directory of its own (rank-R under
 * each nvme path) and meet the other ranks. One rank: nothing but exact accumulation,
 * where it is needed. */
/* Where rank `rank` of `world` keeps its swap files under base (malloc'd; NULL: no memory). */
char *train_rank_dir(const char *base, int world, int rank)
{
    char *d = NULL;
    if (world <= 1) return strdup(base);
    return asprintf(&d, "%s/rank-%d-of-%d", base, rank, world) < 0 ? NULL : d;
}

/* ---- resuming on another number of ranks ------------------------------------------ */

/* The newest step that every one of the `world` ranks saved under base holds, as its
 * current version or the previous one (a checkpoint that some ranks committed and others
 * did not); -1 when some rank holds none of the others' (or nothing), -2 for a run saved
 * before checkpoints were tagged with their step (every rank's manifest untagged). *newest
 * receives the newest step any rank holds. */
static int64_t common_step(const struct trainer *t, const char *base, int world,
                           int64_t *newest)
{
    int64_t tags[COMM_MAX_RANKS][2];
    int untagged = 0;
    *newest = -1;
    for (int q = 0; q < world; q++) {
        int r;
        if (world == t->world && t->peer_saved) { /* as each rank sees its own folder */
            r = (int)t->peer_saved[q][0];
            tags[q][0] = t->peer_saved[q][1];
            tags[q][1] = t->peer_saved[q][2];
        } else {
            char *d = train_rank_dir(base, world, q);
            r = d ? zinf_saved_steps(d, tags[q]) : -ENOMEM;
            free(d);
        }
        if (r < 0) return -1;
        untagged += tags[q][0] < 0;
        *newest = MAX(*newest, tags[q][0]);
    }
    if (untagged) return untagged == world ? -2 : -1;
    int64_t best = -1;
    for (int q = 0; q < world; q++)
        for (int k = 0; k < 2; k++) {
            int64_t c = tags[q][k];
            if (c <= best) continue;
            bool all = true;
            for (int p = 0; p < world && all; p++)
                all = tags[p][0] == c || tags[p][1] == c;
            if (all) best = c;
        }
    return best;
}

/* The run to resume from, of those saved under the nvme paths (one rank's in the paths
 * themselves, N ranks' in rank-R-of-N): its number of ranks (0: none) and the step every
 * one of its ranks saved (*step; -1 for a run saved before steps were tagged). A run that
 * some rank saved no step of that the others hold (a re-cut cut short) is passed over.
 * The run with the newest such step wins; on a tie, this run's number of ranks, then the
 * newest. Runs saved before steps were tagged count only where no other run is known, the
 * newest of them winning. *newest_any: the newest step any rank of the winner holds. */
int train_newest_run(const struct trainer *t, int64_t *step, int64_t *newest_any)
{
    int world = 0, legacy = 0;
    int64_t best = -1, any = -1;
    int64_t best_t = 0, legacy_t = 0, when; /* ns since the epoch */
    *step = -1;
    *newest_any = -1;
    if (!t->nbase) return 0;
    /* The candidates: one rank's run in the path itself, and every rank-0-of-N. */
    int worlds[COMM_MAX_RANKS + 1], nc = 0;
    worlds[nc++] = 1;
    DIR *d = opendir(t->base[0]);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        int n = 0, end = 0;
        if (sscanf(de->d_name, "rank-0-of-%d%n", &n, &end) == 1 && !de->d_name[end] && n >= 2 &&
            n <= COMM_MAX_RANKS && nc <= COMM_MAX_RANKS)
            worlds[nc++] = n;
    }
    if (d) closedir(d);
    for (int k = 0; k < nc; k++) {
        int n = worlds[k];
        char *r0 = train_rank_dir(t->base[0], n, 0);
        int sr = r0 ? zinf_saved_at(r0, &when) : -ENOMEM;
        free(r0);
        if (sr < 0) continue;
        int64_t top, c = common_step(t, t->base[0], n, &top);
        if (c == -2) { /* untagged: by its time, as before tags */
            if (!legacy || when > legacy_t) {
                legacy = n;
                legacy_t = when;
            }
            continue;
        }
        if (c < 0) continue; /* no step every rank holds */
        bool newer = when > best_t;
        if (!world || c > best || (c == best && world != t->world && (n == t->world || newer))) {
            world = n;
            best = c;
            any = top;
            best_t = when;
        }
    }
    if (!world && legacy) return legacy;
    *step = best;
    *newest_any = any;
    return world;
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

/* One rank's share (rank q of `world`) of a saved run, removed from every nvme path: its
 * manifests and swap files (zinf_saved_remove, which touches nothing else), then its
 * rank-q-of-N folders where that left them empty. *had: whether it held a saved state. */
static int remove_rank_share(struct trainer *t, int world, int q, bool *had)
{
    char *dirs[CONFIG_MAX_NVME_PATHS + 1] = {0}; /* NULL-terminated */
    int r = 0;
    size_t n;
    for (unsigned k = 0; k < t->nbase && r == 0; k++)
        if (!(dirs[k] = train_rank_dir(t->base[k], world, q))) r = -ENOMEM;
    if (r == 0) {
        *had = zinf_saved_tensors(dirs[0], &n) == 0;
        r = zinf_saved_remove(dirs[0], (const char *const *)dirs + 1);
    }
    for (unsigned k = 0; k < t->nbase; k++) {
        if (r == 0 && world > 1) rmdir(dirs[k]); /* only where nothing else is left */
        free(dirs[k]);
    }
    return r;
}

/* --overwrite starts over the whole swap path, not only this run's share of it: a run saved
 * there by another number of ranks would otherwise stay, and a later --resume, going to the
 * newest step saved, would continue that one instead of the new run. This run's own files
 * the engines start over; here go one rank's run in the paths themselves (when this run has
 * several) and every rank-R-of-N with N not this run's number of ranks. Only zinf's files
 * of those runs are removed, and their folders once empty; rank 0 does it, before the
 * engines open, each run it removes said. */
int train_remove_other_runs(struct trainer *t, char *err, size_t errlen)
{
    bool removed[COMM_MAX_RANKS + 1] = {false};
    int r = 0, failed_world = 0;
    if (!t->nbase) return 0;
    if (t->world > 1) {
        r = remove_rank_share(t, 1, 0, &removed[1]);
        failed_world = r < 0 ? 1 : 0;
    }
    DIR *d = r == 0 ? opendir(t->base[0]) : NULL;
    if (r == 0 && !d && errno != ENOENT) r = -errno;
    struct dirent *de;
    while (r == 0 && d && (de = readdir(d))) {
        int q = 0, n = 0, end = 0;
        struct stat st;
        if (sscanf(de->d_name, "rank-%d-of-%d%n", &q, &n, &end) != 2 || de->d_name[end] || n < 2 ||
            n > COMM_MAX_RANKS || q < 0 || q >= n || n == t->world)
            continue;
        /* A folder of that name, not a link to one elsewhere. */
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode))
            continue;
        bool had = false;
        r = remove_rank_share(t, n, q, &had);
        removed[n] |= had;
        if (r < 0) failed_world = n;
    }
    if (d) closedir(d);
    if (removed[1] && (r == 0 || failed_world != 1))
        log_notice("--overwrite: removed the run saved by one rank in %s", t->base[0]);
    for (int n = 2; n <= COMM_MAX_RANKS; n++)
        if (removed[n] && (r == 0 || n != failed_world))
            log_notice("--overwrite: removed the run saved by %d ranks in %s/rank-*-of-%d", n,
                       t->base[0], n);
    if (r < 0 && failed_world)
        snprintf(err, errlen, "--overwrite: cannot remove the run saved by %d rank%s in %s: %s",
                 failed_world, failed_world > 1 ? "s" : "", t->base[0],
                 r == -EBUSY    ? "its swap files are in use by another engine (one job per "
                                  "swap directory)"
                 : r == -EACCES ? "one of its swap files or manifests is not this user's "
                                  "regular file; remove it by hand"
                                : zinf_strerror(r));
    else if (r < 0)
        snprintf(err, errlen, "--overwrite: %s: %s", t->base[0], zinf_strerror(r));
    return r;
}

/* The open flag that reaches step in swap directory dir: its current version, or the
 * previous one (ZINF_OPEN_PREVIOUS); -ENOENT where it holds neither at that step. */
int train_version_flag(const char *dir, int64_t step, unsigned *flag)
{
    int64_t tags[2];
    int r = zinf_saved_steps(dir, tags);
    if (r < 0) return r;
    if (step < 0 || tags[0] == step) {
        *flag = 0;
        return 0;
    }
    if (tags[1] == step) {
        *flag = ZINF_OPEN_PREVIOUS;
        return 0;
    }
    return -ENOENT;
}

/* Open rank q's engine of the saved run of `world` ranks, read-only, at the step a resume
 * goes to. */
static int open_source(struct trainer *t, int world, int q, zinf_engine **out)
{
    struct zinf_config c = t->zc; /* the same settings; only the directories differ */
    char *dirs[CONFIG_MAX_NVME_PATHS] = {0};
    unsigned flag = 0;
    int r = 0;
    for (unsigned k = 0; k < t->nbase && r == 0; k++) {
        if (!(dirs[k] = train_rank_dir(t->base[k], world, q))) r = -ENOMEM;
        c.nvme_paths.path[k] = dirs[k];
        if (k) c.nvme_paths_extra[k - 1] = dirs[k];
    }
    if (r == 0) r = train_version_flag(dirs[0], t->resume_step, &flag);
    if (r == 0) r = zinf_open_parsed(&c, ZINF_OPEN_READONLY | ZINF_OPEN_NO_PIN | flag, out);
    for (unsigned k = 0; k < t->nbase; k++)
        free(dirs[k]);
    return r;
}

/* Before anything is written: the saved run of src_world ranks must be this model's, data's
 * and global batch's; its stage and step are taken from its rank 0. */
int train_recut_check(struct trainer *t, char *err, size_t errlen)
{
    int N = t->src_world, r = 0;
    int32_t step0 = 0;
    /* Every rank of the saved run: each must hold the step the re-cut goes to, whole, with
     * the same stage as rank 0 (a re-cut reads every rank's shards). */
    for (int q = 0; q < N && r == 0; q++) {
        zinf_engine *se = NULL;
        zinf_tensor h;
        struct train_state s;
        struct zero_state z = {.stage = 0};
        char who[48] = "";
        if (N > 1) snprintf(who, sizeof(who), " (rank %d)", q);
        if ((r = open_source(t, N, q, &se)) < 0) {
            snprintf(err, errlen, "--resume: cannot open the saved run of %d rank%s%s: %s", N,
                     N > 1 ? "s" : "", who, zinf_strerror(r));
            return r;
        }
        if ((r = zinf_lookup(se, STATE_NAME, &h)) < 0 ||
            (r = zinf_read(se, h, 0, &s, sizeof(s))) < 0 ||
            (N > 1 && ((r = zinf_lookup(se, ZERO_NAME, &h)) < 0 ||
                       (r = zinf_read(se, h, 0, &z, sizeof(z))) < 0)))
            snprintf(err, errlen, "--resume: the saved run of %d rank%s%s has no training state: %s",
                     N, N > 1 ? "s" : "", who, zinf_strerror(r));
        else if (q == 0 && (r = state_validate(t, s, N, err, errlen)) == 0) {
            t->src_stage = z.stage;
            t->src_persist = z.persist;
            step0 = s.step_done;
        } else if (q > 0 && (s.step_done != step0 || z.stage != t->src_stage)) {
            snprintf(err, errlen,
                     "--resume: the saved run of %d ranks is not whole: rank 0 saved step %d at "
                     "stage %d, rank %d step %d at stage %d",
                     N, step0, t->src_stage, q, s.step_done, z.stage);
            r = -EINVAL;
        }
        zinf_close(se);
    }
    if (r == 0 && t->resume_step >= 0 && step0 != t->resume_step) {
        snprintf(err, errlen, "--resume: the saved run's manifests say step %lld, its state step %d",
                 (long long)t->resume_step, step0);
        r = -EINVAL;
    }
    return r;
}

/* In bf16 and fp16, the weights the device computes with are cast again from the re-cut
 * parameters: the rank's part of each (its shard at stage 3, else the whole tensor). */
static int refresh_w(struct trainer *t)
{
    size_t most = 0;
    int r = 0;
    for (int i = 0; i < t->ntensors; i++)
        most = MAX(most, train_role_bytes(t, R_P, i) / sizeof(float));
    float *buf = malloc(most * sizeof(float));
    uint16_t *b16 = malloc(most * sizeof(uint16_t));
    for (int i = 0; i < t->ntensors && r == 0 && buf && b16; i++) {
        size_t n = train_role_bytes(t, R_P, i) / sizeof(float);
        if ((r = zinf_read(t->e, t->p[i], 0, buf, n * sizeof(float))) == 0)
            r = train_write_w(t, i, buf, b16, n);
    }
    if (!buf || !b16) r = -ENOMEM;
    free(buf);
    free(b16);
    return r;
}

/* Re-cut: every rank of the saved run in turn, the part of each parameter and Adam state
 * this rank keeps is read from the shards that hold it and written into this run's tensors;
 * then the saved step goes on. Memory: one tensor's worth of floats at a time. */
int train_recut(struct trainer *t, char *err, size_t errlen)
{
    static const enum role roles[] = {R_P, R_M, R_V};
    static const char *const prefix[] = {"p.", "m.", "v."};
    int N = t->src_world, r = 0;
    size_t most = 0;
    for (int i = 0; i < t->ntensors; i++)
        most = MAX(most, t->desc[i].numel);
    float *buf = malloc(most * sizeof(float));
    if (!buf) return -ENOMEM;
    for (int q = 0; q < N && r == 0; q++) {
        zinf_engine *se = NULL;
        char where[64];
        snprintf(where, sizeof(where), N > 1 ? "rank %d of the saved run's %d" : "the saved run",
                 q, N);
        if ((r = open_source(t, N, q, &se)) < 0) {
            snprintf(err, errlen, "--resume: cannot open %s: %s", where, zinf_strerror(r));
            break;
        }
        zinf_tensor h;
        for (int i = 0; i < t->ntensors && r == 0; i++) {
            size_t n = t->desc[i].numel;
            size_t ssh = N > 1 ? align_up((n + (size_t)N - 1) / (size_t)N, SHARD_FLOATS) : n;
            for (int k = 0; k < 3 && r == 0; k++) {
                int src_stage = t->src_stage;
                if (src_stage >= 3 && t->src_persist && n < (size_t)t->src_persist) src_stage = 2;
                bool from_shard = N > 1 && src_stage >= (roles[k] == R_P ? 3 : 1);
                bool to_shard = train_role_bytes(t, roles[k], i) < n * sizeof(float);
                if (!from_shard && q != 0) continue; /* whole in every rank: rank 0's */
                size_t s_lo = from_shard ? (size_t)q * ssh : 0;
                size_t s_hi = from_shard ? MIN(n, s_lo + ssh) : n;
                size_t d_lo = to_shard ? train_shard_lo(t, i) : 0;
                size_t d_hi = to_shard ? d_lo + train_shard_own(t, i) : n;
                size_t a = MAX(s_lo, d_lo), b = MIN(s_hi, d_hi);
                if (a >= b) continue;
                char name[96];
                snprintf(name, sizeof(name), "%s%s", prefix[k], t->desc[i].name);
                zinf_tensor dst = train_wave_handle(t, roles[k], i);
                if ((r = zinf_lookup(se, name, &h)) < 0 ||
                    (r = zinf_read(se, h, (a - s_lo) * sizeof(float), buf,
                                   (b - a) * sizeof(float))) < 0 ||
                    (r = zinf_write(t->e, dst, (a - d_lo) * sizeof(float), buf,
                                    (b - a) * sizeof(float))) < 0)
                    snprintf(err, errlen, "--resume: '%s' of %s: %s", name, where,
                             zinf_strerror(r));
            }
        }
        zinf_close(se);
    }
    free(buf);
    if (r == 0 && t->w != t->p) r = refresh_w(t);
    return r < 0 ? r : train_state_save_step(t, t->step_done);
}

/* The tests' crash (ZINF_TEST_KILL_AT=POINT:RANK:N): this rank dies at POINT of its N-th
 * checkpoint (the first is the one at the start). */
void train_kill_point(struct trainer *t, const char *point)
{
    if (t->kill_point[0] && t->kill_rank == t->rank && t->kill_nth == t->checkpoint_calls &&
        !strcmp(t->kill_point, point))
        raise(SIGKILL);
}

int trainer_checkpoint(struct trainer *t)
{
    struct zinf_stats s0, s1;
    int r = train_update_finish(t);
    if (r < 0) return r;
    zinf_stats(t->e, &s0);
    uint64_t t0 = now_ns();
    /* Across ranks a step is saved by all or by none. Each rank meets the others, saves the
     * step keeping its previous version, and meets them again: from then on every rank
     * holds the step, and the previous version goes. A rank that dies anywhere in between
     * fails the others' meeting; each rank then holds the new step, the previous one or
     * both, and a resume goes to the newest that all hold. The manifests carry the step. */
    t->checkpoint_calls++;
    bool two = t->world > 1 && !t->remote;
    train_kill_point(t, "before-barrier");
    r = t->world > 1 ? comm_barrier(t->hcomm) : 0;
    if (r == 0) train_kill_point(t, "after-barrier");
    if (r == 0) r = train_scratch_reset(t);
    if (r == 0) r = state_save(t);
    if (r == 0)
        r = t->remote ? zinf_flush(t->e)
                      : zinf_flush_step(t->e, t->step_done, two ? ZINF_FLUSH_KEEP_PREVIOUS : 0);
    if (r == 0) train_kill_point(t, "after-rename");
    if (r == 0 && two) r = comm_barrier(t->hcomm);
    if (r == 0 && two) train_kill_point(t, "after-commit");
    if (r == 0 && two) r = zinf_drop_previous(t->e);
    t->checkpoint_failed = r < 0;
    trace_span("train", "checkpoint", t0, NULL, r < 0 ? "failed" : NULL, -1);
    if (r < 0) return r;
    zinf_stats(t->e, &s1);
    t->checkpoints++;
    t->checkpoint_step = t->step_done;
    t->checkpoint_seconds = (double)(now_ns() - t0) / 1e9;
    t->checkpoint_bytes = s1.nvme_bytes_written - s0.nvme_bytes_written;
    return 0;
}
