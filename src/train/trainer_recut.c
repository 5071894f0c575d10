/*
 * trainer_recut.c - a run saved in another layout (other numbers of pipeline stages, of
 * tensor- or sequence-parallel ranks and of ZeRO ranks) re-cut into this run's tensors and
 * shards on --resume: every folder of the saved run checked before anything is written, then
 * each parameter and Adam state of this rank filled bitwise from the folders that hold it.
 *
 * A tensor-parallel rank held slices of the sliced tensors (gpt_tp.h) and the replicated ones
 * whole; its ZeRO copies shards of those. A tensor is put back together whole from the saved
 * tp ranks' slices (each from its shards), then this rank's slice and shard are cut from it.
 * Sequence-parallel ranks held identical whole tensors: their rank 0's folders are read, the
 * others only checked.
 *
 * Not here: the choice of the saved run and of its step (trainer_layouts.c), the state's
 * checks and the checkpoint (trainer_resume.c), this run's shards' geometry
 * (trainer_shards.c).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "train/adamw_states.h"
#include "train/backend.h"
#include "train/gpt_tp.h"
#include "train/trainer_impl.h"

/* Open folder f of the saved run (layout t->src), read-only, at the step a resume goes to. */
static int open_source(struct trainer *t, int f, zinf_engine **out)
{
    struct zinf_config c = t->zc; /* the same settings; only the directories differ */
    /* ... and the device tier's memory: this run's engine keeps its tensors in the arena
     * the ranks' pool lends it, and a source given the same one would load its own over
     * them (and read this rank's writes back as its own). A source maps its own. */
    c.device_arena = NULL;
    c.device_arena_bytes = 0;
    char *dirs[CONFIG_MAX_NVME_PATHS] = {0};
    int r = 0;
    unsigned flag = 0;
    *out = NULL;
    for (unsigned k = 0; k < t->nbase && r == 0; k++) {
        if (!(dirs[k] = train_layout_dir(train_root(t, k), &t->src, f))) r = -ENOMEM;
        c.nvme_paths.path[k] = dirs[k];
        if (k) c.nvme_paths_extra[k - 1] = dirs[k];
    }
    if (r == 0) r = train_version_flag(dirs[0], t->resume_step, &flag);
    if (r == 0) r = zinf_open_parsed(&c, ZINF_OPEN_READONLY | ZINF_OPEN_NO_PIN | flag, out);
    for (unsigned k = 0; k < t->nbase; k++)
        free(dirs[k]);
    return r;
}

/* Before anything is written: every folder of the saved run (each stage's, each tp or sp
 * rank's, each copy's) must be this model's, data's and global batch's, hold the step the
 * re-cut goes to, whole, and be cut at the same ZeRO stage as the first (a re-cut reads
 * every one's tensors, or for sp ranks checks them); the saved tp must cut this model. */
int train_recut_check(struct trainer *t, char *err, size_t errlen)
{
    const struct train_lay *l = &t->src;
    int F = l->P * l->T * l->S * l->N, r = 0;
    int32_t step0 = 0;
    char lay[96], who[64], w0[64], msg[256];
    train_layout_name(l, lay, sizeof(lay));
    train_folder_name(l, 0, w0, sizeof(w0));
    /* The pieces are cut and joined as floats; a compressed state's blocks and scales are
     * not cut here. */
    if (t->o.state_dtype != 0) {
        snprintf(err, errlen,
                 "--resume: the run saved as %s is re-cut into another layout with Adam's "
                 "states in fp32 only, and zinf.optimizer_state_dtype is \"%s\": resume it in "
                 "its own layout",
                 lay, adamw_state_dtype_name((enum adamw_state_dtype)t->o.state_dtype));
        return -ENOTSUP;
    }
    if (l->T > 1 && gpt_tp_validate(&t->cfg, l->T, 0, msg, sizeof(msg)) < 0) {
        snprintf(err, errlen,
                 "--resume: the saved run of %s in %s cannot be cut again for this model: "
                 "tensor_parallel.autotp_size %d: %s",
                 lay, train_root(t, 0), l->T, msg);
        return -EINVAL;
    }
    for (int f = 0; f < F && r == 0; f++) {
        zinf_engine *se = NULL;
        zinf_tensor h;
        struct train_state s;
        struct zero_state z = {.stage = 0};
        char at[200] = "";
        if (F > 1) {
            char *d = train_layout_dir(train_root(t, 0), l, f);
            snprintf(at, sizeof(at), " (%s, %s)", train_folder_name(l, f, who, sizeof(who)),
                     d ? d : "?");
            free(d);
        }
        if ((r = open_source(t, f, &se)) < 0) {
            snprintf(err, errlen, "--resume: cannot open the saved run of %s%s: %s", lay, at,
                     zinf_strerror(r));
            return r;
        }
        if ((r = zinf_lookup(se, STATE_NAME, &h)) < 0 ||
            (r = zinf_read(se, h, 0, &s, sizeof(s))) < 0 ||
            (l->N > 1 && ((r = zinf_lookup(se, ZERO_NAME, &h)) < 0 ||
                          (r = zinf_read(se, h, 0, &z, sizeof(z))) < 0)))
            snprintf(err, errlen, "--resume: the saved run of %s%s has no training state: %s",
                     lay, at, zinf_strerror(r));
        else if ((r = train_state_validate(t, s, l->N, err, errlen)) < 0)
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

/* One stage of the saved run, open: its folders' engines, tp rank j's copy q at j N + q (sp
 * ranks: their rank 0's alone), and what a read from them is named by in errors. */
struct src_stage {
    zinf_engine **e;
    int s, T, N;
    char where[160];
};

/* Floats of tensor gd on saved tp rank j: its slice, or the whole tensor (no tp). */
static size_t src_numel(struct trainer *t, const struct gpt_tensor_desc *gd, int j)
{
    size_t shape[2];
    if (t->src.T <= 1) return gd->numel;
    return gpt_tp_tensor_shape(&t->cfg, t->src.T, j, gd, shape) < 0 ? 0 : shape[0] * shape[1];
}

/* buf = elements [lo, hi) of `name` (n floats on saved tp rank j), read from the copies'
 * shards that hold them (ZeRO: each copy ceil(n / N) rounded up to SHARD_FLOATS), or from
 * copy `whole_q` where it held it whole (0 where every copy did; an expert's owner). */
static int read_src(struct trainer *t, const struct src_stage *st, int j, const char *name,
                    size_t n, bool from_shard, int whole_q, size_t lo, size_t hi, float *buf,
                    char *err, size_t errlen)
{
    size_t ssh = from_shard ? align_up((n + (size_t)st->N - 1) / (size_t)st->N, SHARD_FLOATS)
                            : n,
           got = 0;
    int r = 0;
    for (int q = 0; q < (from_shard ? st->N : 1) && r == 0; q++) {
        size_t s_lo = (size_t)q * ssh, s_hi = MIN(n, s_lo + ssh);
        size_t a = MAX(lo, s_lo), b = MIN(hi, s_hi);
        zinf_tensor h;
        if (a >= b) continue;
        int c = from_shard ? q : whole_q;
        zinf_engine *se = st->e[j * st->N + c];
        if ((r = zinf_lookup(se, name, &h)) < 0 ||
            (r = zinf_read(se, h, (a - s_lo) * sizeof(float), buf + (a - lo),
                           (b - a) * sizeof(float))) < 0) {
            char who[64];
            struct train_lay l = t->src;
            int f = (st->s * l.T * l.S + j) * l.N + c;
            snprintf(err, errlen, "--resume: '%s' of %s of %s: %s", name,
                     train_folder_name(&l, f, who, sizeof(who)), st->where, zinf_strerror(r));
        }
        got += b - a;
    }
    if (r == 0 && got != hi - lo) {
        snprintf(err, errlen, "--resume: '%s' of %s: its shards hold %zu of %zu elements", name,
                 st->where, got, hi - lo);
        r = -EIO;
    }
    return r;
}

/* Buffers of the largest tensor's floats: the whole tensor, a saved slice, this rank's. */
struct recut_bufs {
    float *whole, *slice, *mine;
};

/* Role k (parameters, m, v) of this rank's tensor i, from saved stage st: the part this rank
 * keeps (its shard, or all of it) of its slice (or the whole tensor). */
static int recut_role(struct trainer *t, const struct src_stage *st, int i, enum role role,
                      const char *prefix, struct recut_bufs *b, char *err, size_t errlen)
{
    const struct gpt_tensor_desc *gd = &t->gdesc[t->gidx[i]];
    size_t n = t->desc[i].numel, whole = gd->numel;
    bool to_shard = train_role_bytes(t, role, i) < n * sizeof(float);
    size_t d_lo = to_shard ? train_shard_lo(t, i) : 0;
    size_t d_hi = to_shard ? d_lo + train_shard_own(t, i) : n;
    char name[96];
    int r = 0;
    if (d_lo >= d_hi) return 0;
    snprintf(name, sizeof(name), "%s%s", prefix, t->desc[i].name);
    zinf_tensor dst = train_wave_handle(t, role, i);
    /* The saved ZeRO cut of a tensor: as its saved rank held it (a slice under tp). */
    bool from_shard[COMM_MAX_RANKS];
    size_t sn[COMM_MAX_RANKS] = {0};
    /* An expert of expert-parallel ranks: whole in its owner's folder alone. */
    bool expert = train_moe_expert(t, &t->desc[i]);
    int whole_q = train_moe_owner(t, &t->desc[i], st->N);
    for (int j = 0; j < st->T; j++) {
        int stage = t->src_stage;
        sn[j] = src_numel(t, gd, j);
        if (stage >= 3 && t->src_persist && sn[j] < (size_t)t->src_persist) stage = 2;
        from_shard[j] = st->N > 1 && stage >= (role == R_P ? 3 : 1) && !expert;
        if (!sn[j]) {
            snprintf(err, errlen, "--resume: '%s' of %s: tp rank %d of %d holds no slice of it",
                     name, st->where, j, st->T);
            return -EINVAL;
        }
    }
    const float *out; /* the elements [d_lo, d_hi) of this rank's tensor */
    if (sn[0] == whole && n == whole) {
        /* Whole on both sides (no tp, or a replicated tensor, the same on every tp rank):
         * the elements this rank keeps, straight from the shards that hold them. */
        r = read_src(t, st, 0, name, whole, from_shard[0], whole_q, d_lo, d_hi, b->mine, err,
                     errlen);
        out = b->mine;
    } else {
        /* The whole tensor from every saved tp rank's slice, then this rank's slice of it. */
        for (int j = 0; j < st->T && r == 0; j++) {
            float *to = st->T > 1 ? b->slice : b->whole;
            r = read_src(t, st, j, name, sn[j], from_shard[j], whole_q, 0, sn[j], to, err,
                         errlen);
            if (r == 0 && st->T > 1 &&
                (r = gpt_tp_slice_in(&t->cfg, st->T, j, gd, to, b->whole)) < 0)
                snprintf(err, errlen, "--resume: '%s' of %s: its tp rank %d's slice does not "
                                      "fit this model",
                         name, st->where, j);
        }
        out = b->whole + d_lo;
        if (r == 0 && t->tp > 1) {
            r = gpt_tp_slice_out(&t->cfg, t->tp, t->tr, gd, b->whole, b->mine);
            out = b->mine + d_lo;
            if (r < 0)
                snprintf(err, errlen, "--resume: '%s': tensor_parallel.autotp_size %d does not "
                                      "cut it",
                         name, t->tp);
        }
    }
    if (r == 0 && (r = zinf_write(t->e, dst, 0, out, (d_hi - d_lo) * sizeof(float))) < 0)
        snprintf(err, errlen, "--resume: '%s': %s", name, zinf_strerror(r));
    return r;
}

/* Opens the engines of stage s of the saved run into st (the tp ranks' copies, or sp rank
 * 0's): all of them or none. */
static int open_stage(struct trainer *t, int s, struct src_stage *st, char *err, size_t errlen)
{
    const struct train_lay *l = &t->src;
    char lay[96], who[64];
    int r = 0;
    st->s = s;
    st->T = l->T;
    st->N = l->N;
    train_layout_name(l, lay, sizeof(lay));
    if (l->P > 1)
        snprintf(st->where, sizeof(st->where), "stage %d of the saved run of %s", s, lay);
    else
        snprintf(st->where, sizeof(st->where), "the saved run of %s", lay);
    if (!(st->e = calloc((size_t)(st->T * st->N), sizeof(*st->e)))) return -ENOMEM;
    for (int j = 0; j < st->T && r == 0; j++)
        for (int q = 0; q < st->N && r == 0; q++) {
            int f = (s * l->T * l->S + j) * l->N + q;
            if ((r = open_source(t, f, &st->e[j * st->N + q])) < 0)
                snprintf(err, errlen, "--resume: cannot open %s of the saved run of %s: %s",
                         train_folder_name(l, f, who, sizeof(who)), lay, zinf_strerror(r));
        }
    return r;
}

static void close_stage(struct src_stage *st)
{
    for (int k = 0; st->e && k < st->T * st->N; k++)
        zinf_close(st->e[k]);
    free(st->e);
    st->e = NULL;
}

/* Re-cut: stage by stage of the saved run, each of this rank's tensors that stage holds (by
 * its name: the last stage's copy of wte is the first's, bit for bit), its parameters, m and
 * v filled from the saved tp ranks' and copies' folders; then the saved step goes on.
 * Memory: three of the largest tensor's floats, and the engines of one saved stage. */
int train_recut(struct trainer *t, char *err, size_t errlen)
{
    static const enum role roles[] = {R_P, R_M, R_V};
    static const char *const prefix[] = {"p.", "m.", "v."};
    int r = 0;
    size_t most = 0;
    char lay[96];
    train_layout_name(&t->src, lay, sizeof(lay));
    for (int i = 0; i < t->ntensors; i++)
        most = MAX(most, t->gdesc[t->gidx[i]].numel);
    struct recut_bufs b = {malloc(most * sizeof(float)), malloc(most * sizeof(float)),
                           malloc(most * sizeof(float))};
    int *from = malloc(sizeof(int) * (size_t)t->ntensors); /* the stage that holds tensor i */
    if (!b.whole || !b.slice || !b.mine || !from) r = -ENOMEM;
    for (int i = 0; i < t->ntensors && r == 0; i++)
        from[i] = -1;
    for (int s = 0; s < t->src.P && r == 0; s++) {
        struct src_stage st = {0};
        zinf_tensor h;
        if ((r = open_stage(t, s, &st, err, errlen)) < 0) {
            close_stage(&st);
            break;
        }
        for (int i = 0; i < t->ntensors && r == 0; i++) {
            char name[96];
            /* Each stage's first folder holds every tensor of its stage (a slice, a shard),
             * but an expert, whole in its owner's alone. */
            if (from[i] < 0) {
                snprintf(name, sizeof(name), "p.%s", t->desc[i].name);
                if ((r = zinf_lookup(st.e[train_moe_owner(t, &t->desc[i], st.N)], name, &h)) ==
                    0)
                    from[i] = s;
                else if (r == -ENOENT)
                    r = 0;
                else
                    snprintf(err, errlen, "--resume: '%s' of %s: %s", name, st.where,
                             zinf_strerror(r));
            }
            for (int k = 0; k < 3 && r == 0 && from[i] == s; k++)
                r = recut_role(t, &st, i, roles[k], prefix[k], &b, err, errlen);
        }
        /* fp16: the loss scaler goes on where the saved run left it (every folder holds the
         * same). */
        if (r == 0 && s == 0 && t->be->wdt == BACKEND_F16 &&
            ((r = zinf_lookup(st.e[0], SCALER_NAME, &h)) < 0 ||
             (r = zinf_read(st.e[0], h, 0, &t->ls, sizeof(t->ls))) < 0 ||
             (r = zinf_write(t->e, t->scaler, 0, &t->ls, sizeof(t->ls))) < 0))
            snprintf(err, errlen, "--resume: '%s' of %s: %s", SCALER_NAME, st.where,
                     zinf_strerror(r));
        close_stage(&st);
    }
    for (int i = 0; i < t->ntensors && r == 0; i++)
        if (from[i] < 0) {
            snprintf(err, errlen, "--resume: '%s' is in no stage of the saved run of %s",
                     t->desc[i].name, lay);
            r = -ENOENT;
        }
    free(b.whole);
    free(b.slice);
    free(b.mine);
    free(from);
    if (r == 0 && t->w != t->p) r = refresh_w(t);
    return r < 0 ? r : train_state_save_step(t, t->step_done);
}
