/*
 * trainer_resume.c - what a run saves and how it comes back: the state tensor (the model,
 * the data and the step) saved and validated, a checkpoint (saved by every rank or by
 * none: each keeps its previous version until all hold the new one), and the version of a
 * folder a resume opens. The tests' crash points are here too.
 *
 * Not here: opening the engine (trainer.c), the choice of the run and step a resume goes to
 * (trainer_layouts.c), the re-cut of a run saved in another layout (trainer_recut.c),
 * registering the tensors (trainer_tensors.c), the shards' geometry (trainer_shards.c).
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

/* The saved state s, of a run of src_world copies, against this run: the same model, data,
 * precision and global batch (micro-batches x copies: tp and sp ranks share theirs). */
int train_state_validate(struct trainer *t, struct train_state s, int src_world, char *err,
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
        char ranks[400] = "", by[96], mine[96];
        struct train_lay src = t->src.N ? t->src : (struct train_lay){1, 1, 1, src_world};
        struct train_lay own = train_own_layout(t);
        if (src_world != t->world)
            snprintf(ranks, sizeof(ranks),
                     " (by %s: %lld micro-batches a step, which %s run%s as --accumulate "
                     "%lld%s)",
                     train_layout_name(&src, by, sizeof(by)), (long long)total,
                     train_layout_name(&own, mine, sizeof(mine)),
                     own.P * own.T * own.S * own.N == 1 ? "s" : "", (long long)(total / t->world),
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
    return train_state_validate(t, s, t->world, err, errlen);
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
