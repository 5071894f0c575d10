/*
 * trainer_resume.c - what a run saves and how it comes back: the state tensor (the model,
 * the data and the step) saved and validated, a checkpoint (saved by every rank or by
 * none: each keeps its previous version until all hold the new one), and the re-cut of a
 * run saved in another layout (other numbers of pipeline stages and of ranks) into this
 * run's tensors and shards. The tests' crash points are here too.
 *
 * Not here: opening the engine (trainer.c), the choice of the run and step a resume goes to
 * (trainer_layouts.c), registering the tensors (trainer_tensors.c), the shards' geometry
 * (trainer_shards.c).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
        char ranks[320] = "", by[64], mine[64];
        if (src_world != t->world)
            snprintf(ranks, sizeof(ranks),
                     " (by %s: %lld micro-batches a step, which %s run%s as --accumulate "
                     "%lld%s)",
                     train_layout_name(t->src_pp ? t->src_pp : 1, src_world, by, sizeof(by)),
                     (long long)total, train_layout_name(t->pp, t->world, mine, sizeof(mine)),
                     t->pp <= 1 && t->world <= 1 ? "s" : "", (long long)(total / t->world),
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

/* ---- resuming in another layout ---------------------------------------------------- */

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

/* Open folder f (stage f / N, rank f % N) of the saved run of src_pp stages x src_world
 * ranks, read-only, at the step a resume goes to. */
static int open_source(struct trainer *t, int f, zinf_engine **out)
{
    struct zinf_config c = t->zc; /* the same settings; only the directories differ */
    /* ... and the device tier's memory: this run's engine keeps its tensors in the arena
     * the ranks' pool lends it, and a source given the same one would load its own over
     * them (and read this rank's writes back as its own). A source maps its own. */
    c.device_arena = NULL;
    c.device_arena_bytes = 0;
    char *dirs[CONFIG_MAX_NVME_PATHS] = {0};
    int P = t->src_pp, N = t->src_world, r = 0;
    unsigned flag = 0;
    for (unsigned k = 0; k < t->nbase && r == 0; k++) {
        if (!(dirs[k] = train_layout_dir(train_root(t, k), P, N, f / N, f % N))) r = -ENOMEM;
        c.nvme_paths.path[k] = dirs[k];
        if (k) c.nvme_paths_extra[k - 1] = dirs[k];
    }
    if (r == 0) r = train_version_flag(dirs[0], t->resume_step, &flag);
    if (r == 0) r = zinf_open_parsed(&c, ZINF_OPEN_READONLY | ZINF_OPEN_NO_PIN | flag, out);
    for (unsigned k = 0; k < t->nbase; k++)
        free(dirs[k]);
    return r;
}

/* Before anything is written: every folder of the saved run (each stage's, each rank's) must
 * be this model's, data's and global batch's, hold the step the re-cut goes to, whole, and
 * be cut at the same ZeRO stage as the first (a re-cut reads every one's tensors). */
int train_recut_check(struct trainer *t, char *err, size_t errlen)
{
    int P = t->src_pp, N = t->src_world, r = 0;
    int32_t step0 = 0;
    char lay[64], who[48], w0[48];
    train_layout_name(P, N, lay, sizeof(lay));
    train_folder_name(P, N, 0, w0, sizeof(w0));
    for (int f = 0; f < P * N && r == 0; f++) {
        zinf_engine *se = NULL;
        zinf_tensor h;
        struct train_state s;
        struct zero_state z = {.stage = 0};
        char at[64] = "";
        if (P * N > 1)
            snprintf(at, sizeof(at), " (%s)", train_folder_name(P, N, f, who, sizeof(who)));
        if ((r = open_source(t, f, &se)) < 0) {
            snprintf(err, errlen, "--resume: cannot open the saved run of %s%s: %s", lay, at,
                     zinf_strerror(r));
            return r;
        }
        if ((r = zinf_lookup(se, STATE_NAME, &h)) < 0 ||
            (r = zinf_read(se, h, 0, &s, sizeof(s))) < 0 ||
            (N > 1 && ((r = zinf_lookup(se, ZERO_NAME, &h)) < 0 ||
                       (r = zinf_read(se, h, 0, &z, sizeof(z))) < 0)))
            snprintf(err, errlen, "--resume: the saved run of %s%s has no training state: %s",
                     lay, at, zinf_strerror(r));
        else if ((r = state_validate(t, s, N, err, errlen)) < 0)
            ; /* said */
        else if (f == 0) {
            t->src_stage = z.stage;
            t->src_persist = z.persist;
            step0 = s.step_done;
        } else if (s.step_done != step0 || z.stage != t->src_stage) {
            snprintf(err, errlen,
                     "--resume: the saved run of %s is not whole: %s saved step %d at ZeRO stage "
                     "%d, %s step %d at stage %d",
                     lay, w0, step0, t->src_stage, who, s.step_done, z.stage);
            r = -EINVAL;
        }
        zinf_close(se);
    }
    if (r == 0 && t->resume_step >= 0 && step0 != t->resume_step) {
        snprintf(err, errlen, "--resume: the saved run's manifests say step %lld, its state step %d",
                 (long long)t->resume_step, step0);
        r = -EINVAL;
    }
    t->step_done = step0;
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

/* Re-cut: every folder of the saved run in turn (stage by stage, rank by rank), the part of
 * each parameter and Adam state this rank keeps is read from the shards that hold it and
 * written into this run's tensors; then the saved step goes on. A tensor is taken from the
 * first stage that holds it by its name (the last stage's copy of wte is the first's, bit
 * for bit). Memory: one tensor's worth of floats at a time. */
int train_recut(struct trainer *t, char *err, size_t errlen)
{
    static const enum role roles[] = {R_P, R_M, R_V};
    static const char *const prefix[] = {"p.", "m.", "v."};
    int P = t->src_pp, N = t->src_world, r = 0;
    size_t most = 0;
    char lay[64], who[48], where[160];
    train_layout_name(P, N, lay, sizeof(lay));
    for (int i = 0; i < t->ntensors; i++)
        most = MAX(most, t->desc[i].numel);
    float *buf = malloc(most * sizeof(float));
    int *from = malloc(sizeof(int) * (size_t)t->ntensors); /* the stage that holds tensor i */
    if (!buf || !from) {
        free(buf);
        free(from);
        return -ENOMEM;
    }
    for (int i = 0; i < t->ntensors; i++)
        from[i] = -1;
    for (int f = 0; f < P * N && r == 0; f++) {
        int s = f / N, q = f % N;
        zinf_engine *se = NULL;
        if (P * N > 1)
            snprintf(where, sizeof(where), "%s of the saved run of %s",
                     train_folder_name(P, N, f, who, sizeof(who)), lay);
        else
            snprintf(where, sizeof(where), "the saved run");
        if ((r = open_source(t, f, &se)) < 0) {
            snprintf(err, errlen, "--resume: cannot open %s: %s", where, zinf_strerror(r));
            break;
        }
        zinf_tensor h;
        for (int i = 0; i < t->ntensors && r == 0; i++) {
            char name[96];
            size_t n = t->desc[i].numel;
            size_t ssh = N > 1 ? align_up((n + (size_t)N - 1) / (size_t)N, SHARD_FLOATS) : n;
            /* Each stage's rank 0 holds every tensor of its stage, whole or its shard; but an
             * expert, which its owner alone holds, whole. */
            int owner = train_moe_owner(t, &t->desc[i], N);
            if (from[i] < 0 && q == owner) {
                snprintf(name, sizeof(name), "p.%s", t->desc[i].name);
                if ((r = zinf_lookup(se, name, &h)) == 0)
                    from[i] = s;
                else if (r == -ENOENT)
                    r = 0;
                else
                    snprintf(err, errlen, "--resume: '%s' of %s: %s", name, where,
                             zinf_strerror(r));
            }
            if (from[i] != s) continue;
            for (int k = 0; k < 3 && r == 0; k++) {
                int src_stage = t->src_stage;
                if (src_stage >= 3 && t->src_persist && n < (size_t)t->src_persist) src_stage = 2;
                bool from_shard = N > 1 && src_stage >= (roles[k] == R_P ? 3 : 1) &&
                                  !train_moe_expert(t, &t->desc[i]);
                bool to_shard = train_role_bytes(t, roles[k], i) < n * sizeof(float);
                if (!from_shard && q != owner) continue; /* whole in every rank: rank 0's */
                size_t s_lo = from_shard ? (size_t)q * ssh : 0;
                size_t s_hi = from_shard ? MIN(n, s_lo + ssh) : n;
                size_t d_lo = to_shard ? train_shard_lo(t, i) : 0;
                size_t d_hi = to_shard ? d_lo + train_shard_own(t, i) : n;
                size_t a = MAX(s_lo, d_lo), b = MIN(s_hi, d_hi);
                if (a >= b) continue;
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
        /* fp16: the loss scaler goes on where the saved run left it (every folder holds the
         * same). */
        if (r == 0 && f == 0 && t->be->wdt == BACKEND_F16 &&
            ((r = zinf_lookup(se, SCALER_NAME, &h)) < 0 ||
             (r = zinf_read(se, h, 0, &t->ls, sizeof(t->ls))) < 0 ||
             (r = zinf_write(t->e, t->scaler, 0, &t->ls, sizeof(t->ls))) < 0))
            snprintf(err, errlen, "--resume: '%s' of %s: %s", SCALER_NAME, where,
                     zinf_strerror(r));
        zinf_close(se);
    }
    for (int i = 0; i < t->ntensors && r == 0; i++)
        if (from[i] < 0) {
            snprintf(err, errlen, "--resume: '%s' is in no stage of the saved run of %s",
                     t->desc[i].name, lay);
            r = -ENOENT;
        }
    free(buf);
    free(from);
    if (r == 0 && t->w != t->p) r = refresh_w(t);
    return r < 0 ? r : train_state_save_step(t, t->step_done);
}

/* The tests' crash (ZINF_TEST_KILL_AT=POINT:RANK:N): this rank dies at POINT of its N-th
 * checkpoint (the first is the one at the start). */
void train_kill_point(struct trainer *t, const char *point)
{
    if (t->kill_point[0] && t->kill_rank == MAX(0, t->o.rank) && t->kill_nth == t->checkpoint_calls &&
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
    bool many = t->world > 1 || t->mp; /* ZeRO ranks, stages, tensor- or sequence-parallel */
    bool two = many && !t->remote;
    train_kill_point(t, "before-barrier");
    r = many ? train_barrier_all(t) : 0;
    if (r == 0) train_kill_point(t, "after-barrier");
    if (r == 0) r = train_scratch_reset(t);
    if (r == 0) r = state_save(t);
    if (r == 0)
        r = t->remote ? zinf_flush(t->e)
                      : zinf_flush_step(t->e, t->step_done, two ? ZINF_FLUSH_KEEP_PREVIOUS : 0);
    if (r == 0) train_kill_point(t, "after-rename");
    if (r == 0 && two) r = train_barrier_all(t);
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
