/*
 * trainer_pipe_cut.c - the cut of a pipeline (see trainer_pipe.c): which stage, tensor- or
 * sequence-parallel rank and copy of the model this rank is, the blocks each stage holds
 * (balanced by parameters, uniform, or as zinf.train.pipeline_cut gives them), and the
 * stage's tensors: its blocks, the embeddings on the first stage, the final norm and the
 * head's copy of the tied wte on the last, each a tensor-parallel rank's slice where the
 * stage has several.
 *
 * Not here: the stages' links and schedule, what crosses between them and how the stages
 * agree on the norm and the digest (trainer_pipe.c).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common.h"
#include "train/trainer_impl.h"

/* ---- the cut ----------------------------------------------------------------------- */

/* The parameters of stage [b0, b1) (the first and last stages' extras included). */
static uint64_t stage_weight(const struct gpt_config *c, int b0, int b1, bool first, bool last)
{
    uint64_t w = (uint64_t)(b1 - b0) * gpt_block_num_params(c);
    if (first) w += (uint64_t)c->V * c->C + (uint64_t)c->maxT * c->C;
    if (last) w += (uint64_t)c->V * c->C + 2 * (uint64_t)c->C;
    return w;
}

/* Stages of contiguous blocks, each at least one, whose heaviest is the lightest possible;
 * among equals, the one that gives the earlier stages fewer blocks. start[P] = L. */
static int cut_by_parameters(const struct gpt_config *c, int P, int *start)
{
    int L = c->L;
    uint64_t *best = malloc(sizeof(uint64_t) * (size_t)(P + 1) * (size_t)(L + 1));
    int *from = malloc(sizeof(int) * (size_t)(P + 1) * (size_t)(L + 1));
    if (!best || !from) {
        free(best);
        free(from);
        return -ENOMEM;
    }
#define B(s, j) best[(size_t)(s) * (size_t)(L + 1) + (size_t)(j)]
#define F(s, j) from[(size_t)(s) * (size_t)(L + 1) + (size_t)(j)]
    /* B(s, j): the lightest heaviest stage of the first s stages over blocks [0, j). */
    for (int s = 0; s <= P; s++)
        for (int j = 0; j <= L; j++)
            B(s, j) = UINT64_MAX;
    B(0, 0) = 0;
    for (int s = 1; s <= P; s++)
        for (int j = s; j <= L - (P - s); j++)
            for (int i = s - 1; i < j; i++) {
                if (B(s - 1, i) == UINT64_MAX) continue;
                uint64_t w = stage_weight(c, i, j, s == 1, s == P);
                uint64_t m = MAX(B(s - 1, i), w);
                if (m < B(s, j)) {
                    B(s, j) = m;
                    F(s, j) = i;
                }
            }
    int j = L;
    for (int s = P; s >= 1; s--) {
        start[s] = j;
        j = F(s, j);
    }
    start[0] = 0;
#undef B
#undef F
    free(best);
    free(from);
    return 0;
}

/* zinf.train.pipeline_cut "3,5": P - 1 increasing block numbers in (0, L). */
static int cut_given(const char *s, int P, int L, int *start, char *err, size_t errlen)
{
    const char *p = s;
    start[0] = 0;
    for (int k = 1; k < P; k++) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v <= start[k - 1] || v >= L) {
            snprintf(err, errlen,
                     "zinf.train.pipeline_cut \"%s\": stage %d's first block must be a number "
                     "above %d and below the model's %d blocks (the first block of each of the %d "
                     "stages after the first, comma-separated, increasing)",
                     s, k, start[k - 1], L, P - 1);
            return -EINVAL;
        }
        start[k] = (int)v;
        p = end;
        if (k < P - 1 && *p++ != ',') {
            snprintf(err, errlen,
                     "zinf.train.pipeline_cut \"%s\": %d stages need %d block numbers, "
                     "comma-separated",
                     s, P, P - 1);
            return -EINVAL;
        }
    }
    if (*p) {
        snprintf(err, errlen,
                 "zinf.train.pipeline_cut \"%s\": %d stages need %d block numbers, no more", s, P,
                 P - 1);
        return -EINVAL;
    }
    start[P] = L;
    return 0;
}

int train_pipe_shape(struct trainer *t, char *err, size_t errlen)
{
    const struct trainer_opts *o = &t->o;
    int P = t->zc.pipeline.stages > 1 ? t->zc.pipeline.stages : 1;
    int T = t->zc.tensor_parallel.autotp_size > 1 ? t->zc.tensor_parallel.autotp_size : 1;
    int S = t->zc.sequence_parallel_size > 1 ? t->zc.sequence_parallel_size : 1;
    t->pp = P;
    t->ps = 0;
    t->tp = T;
    t->tr = 0;
    t->sp = S;
    t->sq = 0;
    t->mp = P > 1 || T > 1 || S > 1;
    t->kb = 0;
    t->ke = t->cfg.L;
    t->wte_copy = -1;
    t->nslots = 1;
    if (!t->mp) return 0;
    int world = o->world > 1 ? o->world : 1;
    if (T > 1 && S > 1) {
        snprintf(err, errlen,
                 "tensor_parallel.autotp_size %d with sequence_parallel_size %d: "
                 "both cut the heads; use one of them",
                 T, S);
        return -EINVAL;
    }
    int I = T * S; /* the ranks of a stage: tensor or sequence parallel */
    if (world % (P * I) || world > COMM_MAX_RANKS || o->rank < 0 || o->rank >= world) {
        char what[96];
        snprintf(what, sizeof(what), "%s%s%s%s", P > 1 ? "pipeline.stages" : "",
                 P > 1 && I > 1 ? " x " : "", T > 1 ? "tensor_parallel.autotp_size" : "",
                 S > 1 ? "sequence_parallel_size" : "");
        snprintf(err, errlen,
                 "%s = %d: start a multiple of %d ranks, one per stage and tensor- or sequence-"
                 "parallel rank of each copy of the model (zinf launch -n %d, %d, ...), not %d "
                 "(rank %d)",
                 what, P * I, P * I, P * I, 2 * P * I, world, o->rank);
        return -EINVAL;
    }
    if (S > 1) {
        char msg[256];
        if (gpt_sp_check(&t->cfg, S, 0, MAX(1, o->batch), o->seq, msg, sizeof(msg)) < 0) {
            snprintf(err, errlen, "sequence_parallel_size %d: %s", S, msg);
            return -EINVAL;
        }
    }
    if (T > 1) {
        char msg[256];
        if (gpt_tp_validate(&t->cfg, T, 0, msg, sizeof(msg)) < 0) {
            snprintf(err, errlen, "tensor_parallel.autotp_size %d: %s", T, msg);
            return -EINVAL;
        }
    }
    if (P > 1 && t->zc.zero.stage >= 2) {
        snprintf(err, errlen,
                 "zero_optimization.stage %d with pipeline.stages %d: a pipeline keeps its "
                 "stages' gradients whole (stage 0 or 1, as DeepSpeed's pipeline)",
                 t->zc.zero.stage, P);
        return -EINVAL;
    }
    if (P > 1 && t->cfg.L < P) {
        snprintf(err, errlen,
                 "pipeline.stages %d: the model has %d block%s, and each stage needs one", P,
                 t->cfg.L, t->cfg.L == 1 ? "" : "s");
        return -EINVAL;
    }
    if (o->mpi) {
        snprintf(err, errlen,
                 "pipeline stages and tensor-parallel ranks across nodes are not "
                 "built yet (start them on one node)");
        return -ENOTSUP;
    }
    int start[COMM_MAX_RANKS + 1];
    int r;
    if (P == 1) {
        start[0] = 0;
        start[1] = t->cfg.L;
        r = 0;
    } else if (t->zc.zinf.train.pipeline_cut[0])
        r = cut_given(t->zc.zinf.train.pipeline_cut, P, t->cfg.L, start, err, errlen);
    else if (t->zc.pipeline.partition == 1) { /* uniform: the first L % P stages one more */
        start[0] = 0;
        for (int s = 0; s < P; s++)
            start[s + 1] = start[s] + t->cfg.L / P + (s < t->cfg.L % P);
        r = 0;
    } else
        r = cut_by_parameters(&t->cfg, P, start);
    if (r < 0) return r;
    t->tr = o->rank % T;
    t->sq = o->rank % S;
    t->ps = o->rank / I % P;
    t->tpc.tp = T;
    t->tpc.rank = t->tr;
    t->kb = start[t->ps];
    t->ke = start[t->ps + 1];
    /* In flight at once on stage s: P - s micro-batches (their activations kept). */
    t->nslots = MIN(P - t->ps, MAX(1, o->grad_accum));
    /* ZeRO sees the copies of this stage, and its micro-batches are reduced as exact
     * accumulation reduces them (each from zero, folded in order). */
    t->world = world / (P * I);
    t->rank = o->rank / (P * I);
    return 0;
}

/* ---- the stage's tensors ------------------------------------------------------------ */

/* Where each block starts and the four tensors outside the blocks are (-1: not here). */
static void index_layout(struct trainer *t)
{
    t->wte = t->wpe = t->lnfw = t->lnfb = -1;
    for (int i = 0; i < t->ntensors; i++) {
        const struct gpt_tensor_desc *d = &t->desc[i];
        if (d->block >= 0 && d->slot == 0) t->block_first[d->block] = i;
        if (d->block >= 0) continue;
        if (d->slot == GPT_WTE)
            t->wte = i;
        else if (d->slot == GPT_WPE)
            t->wpe = i;
        else if (d->slot == GPT_LNF_W)
            t->lnfw = i;
        else
            t->lnfb = i;
    }
}

/* Tensor parallel: each tensor is this rank's slice of it. */
static int tp_shapes(struct trainer *t)
{
    for (int i = 0; i < t->ntensors && t->tp > 1; i++) {
        struct gpt_tensor_desc *d = &t->desc[i];
        if (gpt_tp_tensor_shape(&t->cfg, t->tp, t->tr, &t->gdesc[t->gidx[i]], d->shape) < 0)
            return -EINVAL;
        d->numel = d->shape[0] * d->shape[1];
    }
    return 0;
}

bool train_tp_sliced(const struct trainer *t, int i)
{
    return t->tp > 1 && t->desc[i].numel != t->gdesc[t->gidx[i]].numel;
}

int train_pipe_layout(struct trainer *t)
{
    int n = t->ntensors;
    if (!(t->gidx = malloc(sizeof(int) * (size_t)(n + 1)))) return -ENOMEM;
    if (!(t->gdesc = malloc(sizeof(*t->gdesc) * (size_t)n))) return -ENOMEM;
    memcpy(t->gdesc, t->desc, sizeof(*t->gdesc) * (size_t)n);
    if (t->pp == 1) {
        /* Expert parallel: the rank's own experts only, whole (ZeRO leaves them alone). */
        t->ep = t->o.moe.E > 0 && t->world > 1 ? t->world : 1;
        if (t->ep > 1 && !(t->priv = calloc((size_t)n, sizeof(bool)))) return -ENOMEM;
        int k = 0;
        for (int i = 0; i < n; i++) {
            if (!train_moe_mine(t, &t->desc[i])) continue;
            if (t->priv) t->priv[k] = train_moe_expert(t, &t->desc[i]);
            t->desc[k] = t->desc[i];
            t->gidx[k++] = i;
        }
        t->ntensors = k;
        index_layout(t);
        return tp_shapes(t);
    }
    bool first = t->ps == 0, last = t->ps == t->pp - 1;
    struct gpt_tensor_desc wte = {0};
    int k = 0, wte_g = -1;
    for (int i = 0; i < n; i++) {
        const struct gpt_tensor_desc *d = &t->desc[i];
        bool mine = d->block >= 0 ? d->block >= t->kb && d->block < t->ke
                    : d->slot == GPT_WTE || d->slot == GPT_WPE ? first
                                                               : last;
        if (d->block < 0 && d->slot == GPT_WTE) {
            wte = *d;
            wte_g = i;
        }
        if (!mine) continue;
        t->desc[k] = *d;
        t->gidx[k++] = i;
    }
    t->wte_copy = -1;
    if (last) { /* the head's copy of the tied wte, last in the stage's order */
        t->desc[k] = wte;
        t->gidx[k] = wte_g;
        t->wte_copy = k++;
    }
    t->ntensors = k;
    index_layout(t);
    return tp_shapes(t);
}
