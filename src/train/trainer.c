/*
 * trainer.c - one training step through the engine (see trainer.h).
 *
 * A step, for a model of L blocks and a batch (B,T), w being what the device computes with
 * (the fp32 parameters p, or their bf16 copies in mixed precision):
 *   forward   a0 = embed(wte, wpe); a[k+1] = block_k(a[k])      w fetched to DEVICE
 *   head      loss, d = head_backward(a[L], lnf, wte)             grads zeroed on first touch
 *   backward  d = block_k^T(a[k], d), g_k += ...  for k = L-1..0  (block internals recomputed)
 *   embed     g_wte, g_wpe += ...
 *   optimizer for every tensor: p, g, m, v (and w) fetched to where the optimizer states
 *             live (HOST, or DEVICE when they are homed there), AdamW, all but g released
 *             dirty; the engine carries a refreshed w to the device on its next fetch.
 * Only the block inputs a[0..L] are kept between forward and backward (activation
 * checkpointing); they are zinf tensors whose home is the host tier. Gradient norms are
 * summed as each gradient is finished, so clipping needs no extra pass. The math runs in a
 * backend (backend.h): every call goes through it, whatever it computes on.
 *
 * The batch of step s is drawn from the data with a generator seeded by (seed, s), and the
 * step count is itself a zinf tensor flushed with everything else: a resumed run sees the
 * same batches and the same states, hence the same losses, as an uninterrupted one.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "config.h"
#include "tiers/cuda_probe.h"
#include "train/adamw.h"
#include "train/backend.h"
#include "train/digest.h"
#include "train/loss_scale.h"
#include "train/ops.h"
#include "train/trainer.h"
#include "trace.h"

#define STATE_NAME "train.state"
#define SCALER_NAME "train.loss_scale"       /* fp16 runs: struct loss_scale */
#define STATE_MAGIC 0x7a696e6674726e33ull    /* "zinftrn3": the tail of the data held out */
#define STATE_MAGIC_V2 0x7a696e6674726e32ull /* "zinftrn2": trained on all of it */
#define HELD_OUT_DIVISOR 10                  /* the last tenth of the data is for validation */
#define ZERO_NAME "train.zero"                /* ranks > 1: struct zero_state */
#define ZERO_MAGIC 0x7a696e667a65726full      /* "zinfzero" */
#define SHARD_FLOATS 1024 /* shards are multiples of 4 KiB (O_DIRECT), and so are the chunks
                             the gradient norm is summed by */
#define NLOCAL (GPT_BLOCK_NSLOTS + 4) /* buffers of one block's tensors, then the four others */
#define MEM_TIERS (ZINF_TIER_HOST + 1) /* the tiers that hold copies in memory: device, host */

/* What a partitioned run's ranks keep beside the state: a resume must cut alike. */
struct zero_state {
    uint64_t magic;
    int32_t world, stage, rank;
    int32_t persist; /* stage 3: stage3_param_persistence_threshold (0: none) */
};

/* What the state tensor holds: enough to refuse a resume with another model or data. */
struct train_state {
    uint64_t magic;
    int32_t step_done; /* steps completed */
    int32_t L, C, NH, maxT, B, T;
    int32_t wdt;      /* enum backend_dtype of the device's weights */
    int32_t accum;    /* micro-batches per step; 0 in states saved before it was kept: 1 */
    int32_t held_out; /* 1: the last tenth of the data is held out for validation (v3) */
    uint64_t seed;
    uint64_t data_bytes;
};

struct trainer {
    struct trainer_opts o;
    struct gpt_config cfg;
    zinf_engine *e;
    bool remote;      /* e is a client of the daemon on o.connect, attached to o.job */
    char job[64 + 1]; /* that job's name */
    struct zinf_config zc;

    int ntensors;
    struct gpt_tensor_desc *desc;
    zinf_tensor *p, *g, *m, *v; /* by layout index: fp32 master, gradient, Adam m and v */
    zinf_tensor *w;             /* what the device computes with: p itself in fp32, else a
                                   bf16 copy that the optimizer refreshes */
    int *block_first;           /* layout index of block k's first tensor */
    int wte, wpe, lnfw, lnfb;   /* layout indices */
    zinf_tensor *act;           /* a[0..L], (B,T,C) each */
    zinf_tensor state;
    zinf_tensor scaler; /* fp16: the loss scaler's state, saved with each step */
    struct loss_scale ls;

    unsigned char *data;
    size_t data_bytes;
    size_t train_bytes;      /* batches come from [0, train_bytes); the rest is held out */
    int *tokens, *targets;   /* (B,T) */
    struct backend *be;      /* where the math runs */
    enum zinf_tier opt_tier; /* where the optimizer runs: DEVICE or HOST */
    int step_done;
    /* A step failed while the optimizer updated the state (its -errno; 0: never): the
     * state in memory is half one step, half the next, and must never be flushed. */
    int torn;
    int checkpoints, checkpoint_step;
    bool checkpoint_failed;      /* the last trainer_checkpoint() failed */
    int fault_tensor, fault_err; /* trainer_fault_optimizer() */
    bool fault_overflow;         /* trainer_fault_overflow() */
    double checkpoint_seconds;
    uint64_t checkpoint_bytes;
    uint64_t peak[3];
    uint64_t min_budget[MEM_TIERS]; /* the smallest device and host budgets that run */
    uint64_t persist_below;         /* stage3_param_persistence_threshold when set: the weights
                                       of fewer elements are homed on the device; 0: none */
    bool state_v2;                  /* resumed from a state saved before the held-out tail */

    /* ZeRO across ranks, and exact accumulation. With exact (several ranks, or several
     * micro-batches on the CPU), each micro-batch's gradients are computed afresh into the
     * local buffers lg and then reduced into g: summed over the ranks in rank order, copied
     * on the step's first micro-batch and added after, so that N ranks of one micro-batch
     * each give bitwise what one rank of N micro-batches does. The clipping norm is then
     * summed by chunks of SHARD_FLOATS in the layout's order, whoever owns them. */
    struct comm *comm;
    int rank, world, stage; /* stage: what is 1/world per rank (see trainer_opts) */
    bool exact;
    /* The digest of the parameters after the last step that computed one (trainer_opts.
     * digest): a skipped step changes nothing, so it reports this. */
    bool have_digest;
    uint64_t digest;
    int micro;              /* the micro-batch being reduced: 0 copies, later ones add */
    zinf_tensor lg[NLOCAL]; /* this micro-batch's gradients: world x shard floats each */
    zinf_tensor lg1[GPT_BLOCK_NSLOTS]; /* overlap: the odd blocks' (the even ones' are lg) */
    zinf_tensor gw[NLOCAL]; /* stage 3: the gathered weights, world x shard floats each */
    zinf_tensor gw1[GPT_BLOCK_NSLOTS]; /* the odd blocks' (the even ones' are gw) */
    int gw_holds[2];        /* the block whose weights gw (0) and gw1 (1) hold, or -1 */
    bool budgeting;         /* min_budgets(): waves as their worst case (every gather) */
    pthread_mutex_t gmu;    /* the next block's gathers in flight: gpending, gerr */
    pthread_cond_t gcv;
    int gpending, gerr;
    struct comm_req greq[GPT_BLOCK_NSLOTS];
    /* overlap_comm: block k's gradients are reduced while block k - 1's backward computes
     * (the previous block's, on the comm's thread, which also folds them into g). */
    bool overlap;
    struct reduce_ctx {
        struct comm_req req;
        struct trainer *t;
        int idx;
        float *g;
        size_t count;
    } rq[GPT_BLOCK_NSLOTS];
    uint64_t reduce_ns; /* the time steps waited for gradient reductions */
    zinf_tensor zstate;     /* struct zero_state */
    float *tmp;             /* (world + 1) x the largest shard: collectives' other side */
    float *losses;          /* world x grad_accum: every micro-batch's loss */
    double *part, *part_all; /* the norm's chunk sums: this rank's, and every rank's */
    size_t nparts;
    size_t *part_first; /* the first chunk of tensor i */
    /* The nvme paths as given: rank R of N keeps its swap files in rank-R-of-N under each
     * (one rank: in the paths themselves). A resume on another number of ranks re-cuts the
     * newest saved run, of src_world ranks at stage src_stage, into this run's shards. */
    char *base[CONFIG_MAX_NVME_PATHS];
    unsigned nbase;
    int src_world, src_stage, src_persist;
    /* The step a resume goes to: the newest saved whole by every rank of the run it comes
     * from (-1: unknown, a run saved before checkpoints were tagged with their step). */
    int64_t resume_step;
    /* ZINF_TEST_KILL_AT=POINT:RANK:N: the tests' crash, at POINT of the N-th checkpoint. */
    char kill_point[32];
    int kill_rank, kill_nth, checkpoint_calls;
};

void trainer_opts_defaults(struct trainer_opts *o)
{
    *o = (struct trainer_opts){.batch = 4,
                               .seq = 64,
                               .steps = 100,
                               .lr = 1e-3f,
                               .weight_decay = 0.0f,
                               .grad_clip = 1.0f,
                               .seed = 1337,
                               .beta1 = 0.9f,
                               .beta2 = 0.999f,
                               .eps = 1e-8f,
                               .grad_accum = 1};
    o->fp16 = (struct trainer_fp16){
        .min_loss_scale = 1, .initial_scale_power = 16, .loss_scale_window = 1000, .hysteresis = 2};
    o->model = (struct gpt_config){.V = 256, .maxT = 64, .L = 4, .C = 128, .NH = 4};
}

int trainer_next_step(const struct trainer *t)
{
    return t->step_done + 1;
}

zinf_engine *trainer_engine(struct trainer *t)
{
    return t->e;
}

static enum zinf_tier home_of(enum config_offload_device d)
{
    return d == CONFIG_OFFLOAD_NVME  ? ZINF_TIER_NVME
           : d == CONFIG_OFFLOAD_CPU ? ZINF_TIER_HOST
                                     : ZINF_TIER_DEVICE;
}

/* ---- setup -------------------------------------------------------------------------- */

static int load_data(struct trainer *t, char *err, size_t errlen)
{
    struct stat st;
    int fd = open(t->o.data_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) < 0) {
        int r = -errno;
        snprintf(err, errlen, "%s: %s", t->o.data_path, strerror(errno));
        if (fd >= 0) close(fd);
        return r;
    }
    if (S_ISDIR(st.st_mode)) {
        snprintf(err, errlen, "--data %s is a directory: give a file, whose bytes are the tokens",
                 t->o.data_path);
        close(fd);
        return -EISDIR;
    }
    if (!S_ISREG(st.st_mode) || (size_t)st.st_size < (size_t)t->o.seq + 1) {
        snprintf(err, errlen, "%s: the data file must hold at least --seq + 1 = %d bytes",
                 t->o.data_path, t->o.seq + 1);
        close(fd);
        return -EINVAL;
    }
    t->data_bytes = (size_t)st.st_size;
    t->data = malloc(t->data_bytes);
    size_t got = 0;
    while (t->data && got < t->data_bytes) {
        ssize_t n = read(fd, t->data + got, t->data_bytes - got);
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    if (!t->data || got != t->data_bytes) {
        snprintf(err, errlen, "%s: cannot read it whole", t->o.data_path);
        return -EIO;
    }
    return 0;
}

double trainer_lr_at(const struct trainer_lr_schedule *s, double lr, int step)
{
    int it = step - 2; /* DeepSpeed's last_batch_iteration when step runs */
    int W = MAX(2, s->warmup_steps);
    double warm = it < 0 ? 0 : s->linear ? (double)it / W : log(it + 1.0) / log((double)W);
    switch (s->type) {
    case TRAINER_SCHED_WARMUP:
    case TRAINER_SCHED_WARMUP_DECAY: {
        if (it < 0) return s->min_lr;
        double gamma =
            it < W ? warm
            : s->type == TRAINER_SCHED_WARMUP
                ? 1.0
                : MAX(0.0, (double)(s->total_steps - it) / MAX(1.0, (double)(s->total_steps - W)));
        return s->min_lr + (s->max_lr - s->min_lr) * gamma;
    }
    case TRAINER_SCHED_WARMUP_COSINE: {
        if (it < 0) return 0;
        if (it < W) return lr * (s->min_ratio + warm * (1 - s->min_ratio));
        double progress = MIN(1.0, (double)(it - W + 1) / MAX(1, s->total_steps - W));
        double ratio = (1 + cos(M_PI * progress)) / 2;
        return lr * MAX(0.0, s->cos_min_ratio + (1 - s->cos_min_ratio) * ratio);
    }
    default:
        return lr;
    }
}

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Micro-batch m of step s: B windows of T+1 bytes at offsets drawn from (seed, s, m). */
static void load_batch(struct trainer *t, int s, int m)
{
    int B = t->o.batch, T = t->o.seq;
    uint64_t span = t->train_bytes - (size_t)T;
    for (int b = 0; b < B; b++) {
        uint64_t off = mix64(t->o.seed * 0x9e3779b97f4a7c15ull + (uint64_t)s * 1000003u +
                             (uint64_t)m * (uint64_t)B + (uint64_t)b) %
                       span;
        for (int i = 0; i < T; i++) {
            t->tokens[b * T + i] = t->data[off + (size_t)i];
            t->targets[b * T + i] = t->data[off + (size_t)i + 1];
        }
    }
}

static void note_peaks(struct trainer *t)
{
    struct zinf_stats st;
    if (zinf_stats(t->e, &st) < 0) return;
    for (int i = 0; i < 3; i++)
        t->peak[i] = MAX(t->peak[i], st.tier[i].peak_bytes);
}

/* ---- the sets a step pins ---------------------------------------------------------- */

/* A step is a sequence of phases, and each phase fetches what it works on as one set
 * (zinf_fetch_all) and releases all of it before the next: nothing is pinned across
 * phases. The engine lays a set out in one run when the tier is fragmented, so a tier that
 * holds its homes plus the largest set a step fetches to it runs every step; one smaller
 * cannot (the set is pinned at once). The same descriptions drive the fetches and the
 * budget check at open, so the check is exact. */
enum role { R_P, R_G, R_M, R_V, R_W, R_ACT, R_L, R_GW };

/* The largest set, a stage-3 block's backward: shards and gathered weights, local gradients,
 * input, the next block's shards and gather buffers and, with overlap_comm, the previous
 * block's local and kept gradients (without it, this block's kept gradients instead). */
#define WAVE_MAX (7 * GPT_BLOCK_NSLOTS + 1)

/* The members are what is fetched and released; the entries, what the phase's code indexes.
 * They are the same but in stage 3, where a weight is two members, the rank's shard of p
 * and the buffer it is gathered into, and one entry, the gathered weights. */
struct wave {
    const char *what; /* for the budget error: what the phase pins at once */
    int n;
    uint8_t role[WAVE_MAX];
    int idx[WAVE_MAX];    /* layout index (an activation's number for R_ACT) */
    bool dirty[WAVE_MAX]; /* released dirty when the phase succeeded */
    int8_t from[WAVE_MAX]; /* the member gathered into this one (stage 3), else -1 */
    bool async[WAVE_MAX];  /* that gather is the next block's: it runs while this one computes */
    int ahead;             /* 1 + the block gathered ahead (async); 0: none */
    bool reduce[WAVE_MAX]; /* a local gradient reduced into the next member (its g) while
                              this set computes (overlap_comm) */
    int behind;            /* 1 + the block whose gradients those are; 0: none */
    int ne;
    int8_t at[WAVE_MAX]; /* entry -> member */
};

static void wave_member(struct wave *w, enum role role, int idx, bool dirty)
{
    if (w->n >= WAVE_MAX) { /* a set this file builds: WAVE_MAX is wrong */
        log_error("trainer: a set of '%s' outgrew WAVE_MAX (%d)", w->what, WAVE_MAX);
        abort();
    }
    w->role[w->n] = (uint8_t)role;
    w->idx[w->n] = idx;
    w->dirty[w->n] = dirty;
    w->from[w->n] = -1;
    w->async[w->n] = false;
    w->reduce[w->n] = false;
    w->n++;
}

static void wave_add(struct wave *w, enum role role, int idx, bool dirty)
{
    w->at[w->ne++] = (int8_t)w->n;
    wave_member(w, role, idx, dirty);
}

static int stage_of(const struct trainer *t, int idx);

/* The weights of tensor idx as the device computes with them: w, or in stage 3 the rank's
 * shard of p gathered from every rank into a buffer of the device tier. */
static void wave_add_weight(const struct trainer *t, struct wave *w, int idx)
{
    if (stage_of(t, idx) < 3) {
        wave_add(w, R_W, idx, false);
        return;
    }
    wave_member(w, R_P, idx, false);
    wave_add(w, R_GW, idx, false);
    w->from[w->n - 1] = (int8_t)(w->n - 2);
}

/* Whether stage 3 gathers the next block ahead: unless stage3_prefetch_bucket_size is 0, or
 * two blocks' parameters would be more than stage3_max_live_parameters (DeepSpeed's
 * meanings: no prefetch; the most gathered at once). */
static bool gather_ahead(const struct trainer *t)
{
    return t->zc.zero.stage3_prefetch_bucket_size && t->cfg.L > 1 &&
           2 * (uint64_t)gpt_block_num_params(&t->cfg) <= t->zc.zero.stage3_max_live_parameters;
}

/* Which of the two sets of gather buffers block k's weights go to: by its parity when the
 * next block is gathered ahead, else the one set. */
static int gw_set(const struct trainer *t, int k)
{
    return gather_ahead(t) ? k & 1 : 0;
}

/* Whether block k's weights are in its gather buffers already (gathered ahead, or still
 * there from the forward); the budget check counts the worst case, a gather. */
static bool gathered(const struct trainer *t, int k)
{
    return !t->budgeting && t->gw_holds[gw_set(t, k)] == k;
}

/* Which of the two sets of local gradients block k's go to: by its parity when a block's
 * are reduced while the next one computes (overlap_comm), else the one set. */
static int lg_set(const struct trainer *t, int k)
{
    return t->overlap && t->cfg.L > 1 ? k & 1 : 0;
}

static void wave_add_block(struct trainer *t, struct wave *w, enum role role, int k, bool dirty)
{
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++) {
        int idx = t->block_first[k] + i;
        if (role == R_W && stage_of(t, idx) >= 3 && gathered(t, k))
            wave_add(w, R_GW, idx, false);
        else if (role == R_W)
            wave_add_weight(t, w, idx);
        else
            wave_add(w, role, idx, dirty);
    }
}

/* Stage 3: block j's shards and the other gather buffers join the set, and their gather runs
 * while this set's block computes (gather_ahead()). */
static void wave_prefetch_block(struct trainer *t, struct wave *w, int j)
{
    if (t->stage < 3 || !gather_ahead(t) || j < 0 || j >= t->cfg.L || gathered(t, j)) return;
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++) {
        int idx = t->block_first[j] + i;
        if (stage_of(t, idx) < 3) continue;
        wave_member(w, R_P, idx, false);
        wave_member(w, R_GW, idx, false);
        w->from[w->n - 1] = (int8_t)(w->n - 2);
        w->async[w->n - 1] = true;
        w->ahead = j + 1;
    }
}

/* The embeddings' forward: wte, wpe -> a[0]. */
static void wave_embed_forward(struct trainer *t, struct wave *w)
{
    *w = (struct wave){.what = "the embeddings' forward (wte, wpe and the first activation)"};
    wave_add_weight(t, w, t->wte);
    wave_add_weight(t, w, t->wpe);
    wave_add(w, R_ACT, 0, true);
}

/* Block k's forward: its 12 weights, a[k] -> a[k+1]. */
static void wave_block_forward(struct trainer *t, int k, struct wave *w)
{
    *w = (struct wave){.what = "a block's forward (its weights, input and output)"};
    wave_add_block(t, w, R_W, k, false);
    wave_add(w, R_ACT, k, false);
    wave_add(w, R_ACT, k + 1, true);
    wave_prefetch_block(t, w, k + 1);
}

/* The head: a[L], lnf, wte and the gradients of lnf and wte. Exact: the gradients go to
 * the local buffers (entries 4-6), and those of lnf are reduced into g (entries 7, 8); wte's
 * local gradient waits for the embeddings' backward. */
static void wave_head(struct trainer *t, struct wave *w)
{
    *w = (struct wave){.what = "the head (the last activation, the final norm, wte and their "
                               "gradients)"};
    enum role g = t->exact ? R_L : R_G;
    wave_add(w, R_ACT, t->cfg.L, false);
    wave_add_weight(t, w, t->lnfw);
    wave_add_weight(t, w, t->lnfb);
    wave_add_weight(t, w, t->wte);
    wave_add(w, g, t->lnfw, true);
    wave_add(w, g, t->lnfb, true);
    wave_add(w, g, t->wte, true);
    if (t->exact) {
        wave_add(w, R_G, t->lnfw, true);
        wave_add(w, R_G, t->lnfb, true);
    }
}

/* overlap_comm: block j's local gradients and their g join the set, and their reduction
 * runs while this set's phase computes; wave_release waits for it. */
static void wave_reduce_behind(struct trainer *t, struct wave *w, int j)
{
    if (!t->overlap || j < 0 || j >= t->cfg.L) return;
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++) {
        int idx = t->block_first[j] + i;
        wave_member(w, R_L, idx, false);
        w->reduce[w->n - 1] = true;
        wave_member(w, R_G, idx, true);
    }
    w->behind = j + 1;
}

/* Block k's backward: its weights, gradients and input (the block is recomputed). Exact:
 * the gradients go to the local buffers, then are reduced into g (entries 25-36), or with
 * overlap_comm while block k - 1 computes (block k + 1's are reduced during this one). */
static void wave_block_backward(struct trainer *t, int k, struct wave *w)
{
    *w = (struct wave){.what = "a block's backward (its weights, gradients and input)"};
    wave_add_block(t, w, R_W, k, false);
    wave_add_block(t, w, t->exact ? R_L : R_G, k, true);
    wave_add(w, R_ACT, k, false);
    if (t->exact && !t->overlap) wave_add_block(t, w, R_G, k, true);
    wave_prefetch_block(t, w, k - 1);
    wave_reduce_behind(t, w, k + 1);
}

/* Exact: the local gradients of wte and wpe, then their g (entries 2, 3); with overlap_comm,
 * block 0's gradients are reduced meanwhile. */
static void wave_embed_backward(struct trainer *t, struct wave *w)
{
    *w = (struct wave){.what = "the embeddings' backward (the gradients of wte and wpe)"};
    enum role g = t->exact ? R_L : R_G;
    wave_add(w, g, t->wte, true);
    wave_add(w, g, t->wpe, true);
    if (t->exact) {
        wave_add(w, R_G, t->wte, true);
        wave_add(w, R_G, t->wpe, true);
    }
    wave_reduce_behind(t, w, 0);
}

/* The optimizer's update of tensor i: p, g, m, v (and the bf16 copy). */
static void wave_optimizer(struct trainer *t, int i, struct wave *w)
{
    *w = (struct wave){.what = "the optimizer's update of one tensor (its parameters, "
                               "gradient, m and v)"};
    wave_add(w, R_P, i, true);
    wave_add(w, R_G, i, false);
    wave_add(w, R_M, i, true);
    wave_add(w, R_V, i, true);
    if (t->w != t->p) wave_add(w, R_W, i, true);
}

/* Sampling's logits, on the CPU: the last activation, the final norm and wte in fp32. */
static void wave_sample(struct trainer *t, struct wave *w)
{
    *w = (struct wave){.what = "sampling (the last activation, the final norm and wte in fp32)"};
    wave_add(w, R_ACT, t->cfg.L, false);
    wave_add(w, R_P, t->lnfw, false);
    wave_add(w, R_P, t->lnfb, false);
    wave_add(w, R_P, t->wte, false);
}

/* The local and gather buffers are one per block slot (every block's are alike), then one
 * for each tensor outside the blocks. */
static int local_slot(const struct trainer *t, int idx)
{
    const struct gpt_tensor_desc *d = &t->desc[idx];
    return d->block >= 0 ? d->slot : GPT_BLOCK_NSLOTS + d->slot;
}

static zinf_tensor wave_handle(const struct trainer *t, enum role role, int idx)
{
    switch (role) {
    case R_L: /* a block's by its parity: block k + 1's are reduced while block k computes */
        return t->desc[idx].block >= 0 && lg_set(t, t->desc[idx].block) ? t->lg1[t->desc[idx].slot]
                                                                          : t->lg[local_slot(t, idx)];
    case R_GW: /* a block's by its parity: block k + 1's gather runs while block k computes */
        return t->desc[idx].block >= 0 && gw_set(t, t->desc[idx].block) ? t->gw1[t->desc[idx].slot]
                                                                          : t->gw[local_slot(t, idx)];
    case R_P:
        return t->p[idx];
    case R_G:
        return t->g[idx];
    case R_M:
        return t->m[idx];
    case R_V:
        return t->v[idx];
    case R_W:
        return t->w[idx];
    default:
        return t->act[idx];
    }
}

static int wave_release(struct trainer *t, const struct wave *w, enum zinf_tier tier, bool ok);
static size_t shard_of(const struct trainer *t, int idx);

static void reduce_req(struct trainer *t, int i, float *l, float *g, struct comm_req *q);
static int fold_grad(struct trainer *t, int i, const float *src, float *g, size_t count);

/* An asynchronous collective of the set finished (the comm's thread): count it, and keep
 * the first error for wave_release. */
static void async_done(struct trainer *t, int res)
{
    pthread_mutex_lock(&t->gmu);
    if (res < 0 && !t->gerr) t->gerr = res;
    t->gpending--;
    pthread_cond_broadcast(&t->gcv);
    pthread_mutex_unlock(&t->gmu);
}

static void gather_done(struct comm_req *req, int res)
{
    async_done(req->data, res);
}

/* A block's gradient reduced behind the next block's backward: folded into g here, on the
 * comm's thread, while the main thread computes (wave_release waits for it). */
static void reduce_done(struct comm_req *req, int res)
{
    struct reduce_ctx *x = req->data;
    if (res == 0) res = fold_grad(x->t, x->idx, req->recv, x->g, x->count);
    async_done(x->t, res);
}

/* Queue the async collective of request q (its callback set); a refused one counts as done
 * with its error. */
static int submit_async(struct trainer *t, struct comm_req *q)
{
    pthread_mutex_lock(&t->gmu);
    t->gpending++;
    pthread_mutex_unlock(&t->gmu);
    int x = comm_submit(t->comm, q);
    if (x < 0) q->cb(q, x); /* the callback never fires: count it here */
    return x;
}

/* Fetch the set and, in stage 3, gather the weights; ptrs[j] is entry j's. */
static int wave_fetch(struct trainer *t, const struct wave *w, enum zinf_tier tier, void **ptrs)
{
    zinf_tensor hs[WAVE_MAX];
    void *m[WAVE_MAX];
    for (int i = 0; i < w->n; i++)
        hs[i] = wave_handle(t, (enum role)w->role[i], w->idx[i]);
    int r = zinf_fetch_all(t->e, hs, (size_t)w->n, tier, m);
    if (r < 0) return r; /* nothing is pinned */
    int blk = -1;
    for (int i = 0; i < w->n && r == 0; i++)
        if (w->from[i] >= 0 && !w->async[i]) {
            if ((blk = t->desc[w->idx[i]].block) >= 0) t->gw_holds[gw_set(t, blk)] = -1;
            r = comm_allgather(t->comm, m[w->from[i]], m[i], shard_of(t, w->idx[i]), COMM_F32);
        }
    if (r == 0 && blk >= 0) t->gw_holds[gw_set(t, blk)] = blk;
    /* The next block's gathers, behind this one's compute: wave_release waits for them. */
    if (r == 0 && w->ahead) t->gw_holds[gw_set(t, w->ahead - 1)] = -1;
    int q = 0;
    for (int i = 0; i < w->n && r == 0; i++) {
        if (!w->async[i]) continue;
        struct comm_req *req = &t->greq[q++];
        *req = (struct comm_req){.op = COMM_ALLGATHER,
                                 .dtype = COMM_F32,
                                 .send = m[w->from[i]],
                                 .recv = m[i],
                                 .count = shard_of(t, w->idx[i]),
                                 .cb = gather_done,
                                 .data = t};
        if (submit_async(t, req) < 0) break;
    }
    /* The previous block's gradient reductions, behind this set's compute. */
    q = 0;
    for (int i = 0; i < w->n && r == 0; i++) {
        if (!w->reduce[i]) continue;
        struct reduce_ctx *x = &t->rq[q++];
        x->t = t;
        x->idx = w->idx[i];
        x->g = m[i + 1];
        reduce_req(t, w->idx[i], m[i], x->g, &x->req);
        x->count = x->req.count;
        x->req.cb = reduce_done;
        x->req.data = x;
        if (submit_async(t, &x->req) < 0) break;
    }
    if (r < 0) {
        wave_release(t, w, tier, false);
        return r;
    }
    for (int j = 0; j < w->ne; j++)
        ptrs[j] = m[w->at[j]];
    return 0;
}

/* Release the whole set: the members it wrote dirty when the phase succeeded (ok) and so
 * did its async collectives, which finish first: the next block's gathers (they read shards
 * of this set) and the previous block's reductions (they read and write members). Their
 * first error is the answer. */
static int wave_release(struct trainer *t, const struct wave *w, enum zinf_tier tier, bool ok)
{
    int r = 0;
    if (w->ahead || w->behind) {
        uint64_t t0 = now_ns();
        pthread_mutex_lock(&t->gmu);
        while (t->gpending)
            pthread_cond_wait(&t->gcv, &t->gmu);
        r = t->gerr;
        t->gerr = 0;
        pthread_mutex_unlock(&t->gmu);
        if (w->ahead) t->gw_holds[gw_set(t, w->ahead - 1)] = r == 0 ? w->ahead - 1 : -1;
        if (w->behind) t->reduce_ns += now_ns() - t0;
        ok &= r == 0;
    }
    for (int i = 0; i < w->n; i++) {
        int x = zinf_release(t->e, wave_handle(t, (enum role)w->role[i], w->idx[i]), tier,
                             ok && w->dirty[i] ? ZINF_RELEASE_DIRTY : 0);
        if (x < 0 && r == 0) r = x;
    }
    return r;
}

/* Where each tensor lives (as register_all() registers them). What the device computes
 * with (w; p in fp32, where they are one) is homed with the parameters, or on the device
 * itself when it has fewer elements than stage3_param_persistence_threshold (DeepSpeed's
 * persistent parameters: small tensors are not worth a transfer each time). */
static enum zinf_tier role_home(const struct trainer *t, enum role role, int idx)
{
    enum zinf_tier ph = home_of(t->zc.zero.offload_param.device);
    enum zinf_tier oh = home_of(t->zc.zero.offload_optimizer.device);
    bool persist =
        role != R_ACT && t->persist_below && t->desc[idx].numel < (size_t)t->persist_below;
    switch (role) {
    case R_P:
        if (t->w != t->p) return oh; /* the fp32 master is optimizer state */
        return persist ? ZINF_TIER_DEVICE : ph;
    case R_W:
        return persist ? ZINF_TIER_DEVICE : ph;
    case R_ACT:
        return ZINF_TIER_HOST;
    case R_L:
    case R_GW:
        return ZINF_TIER_DEVICE; /* working memory of every step */
    default:
        return oh;
    }
}

/* ---- ZeRO partitions ---------------------------------------------------------------- */

/* Floats per rank of tensor idx: its elements in world parts, each rounded up to
 * SHARD_FLOATS; rank r holds [r x shard, (r + 1) x shard) of the flattened tensor, padded
 * with zeros past its end (a small tensor lives on the first ranks). One rank: the tensor. */
static size_t shard_of(const struct trainer *t, int idx)
{
    size_t n = t->desc[idx].numel;
    if (t->world <= 1) return n;
    return align_up((n + (size_t)t->world - 1) / (size_t)t->world, SHARD_FLOATS);
}

/* The first element of tensor idx this rank holds, and how many of its shard are the
 * tensor's (the rest is padding). */
static size_t shard_lo(const struct trainer *t, int idx)
{
    return (size_t)t->rank * shard_of(t, idx);
}

static size_t shard_own(const struct trainer *t, int idx)
{
    size_t n = t->desc[idx].numel, lo = shard_lo(t, idx);
    return lo >= n ? 0 : MIN(shard_of(t, idx), n - lo);
}

/* The stage tensor idx is partitioned at: stage 3 keeps the weights of fewer elements than
 * stage3_param_persistence_threshold whole on every rank (DeepSpeed's persistent
 * parameters: not worth a gather each time), as stage 2 does. */
static int stage_of(const struct trainer *t, int idx)
{
    if (t->stage >= 3 && t->persist_below && t->desc[idx].numel < (size_t)t->persist_below)
        return 2;
    return t->stage;
}

/* Bytes of what is registered for role (tensor idx): a rank keeps a shard of the Adam
 * states from stage 1, of the gradients from stage 2, of the parameters in stage 3. */
static size_t role_bytes(const struct trainer *t, enum role role, int idx)
{
    if (role == R_ACT)
        return (size_t)t->o.batch * t->o.seq * t->cfg.C * backend_dtype_bytes(t->be->adt);
    size_t n = t->desc[idx].numel, sh = shard_of(t, idx);
    bool parted = t->world > 1;
    switch (role) {
    case R_L:
    case R_GW:
        return (size_t)t->world * sh * sizeof(float);
    case R_M:
    case R_V:
        return (parted && t->stage >= 1 ? sh : n) * sizeof(float);
    case R_G:
        return (parted && t->stage >= 2 ? sh : n) * sizeof(float);
    case R_P:
        return (parted && stage_of(t, idx) >= 3 ? sh : n) * sizeof(float);
    default:
        return n * backend_dtype_bytes(t->be->wdt);
    }
}

/* A representative tensor of each local slot (block 0's, or the tensor itself). */
static int slot_tensor(const struct trainer *t, int s)
{
    if (s < GPT_BLOCK_NSLOTS) return t->block_first[0] + s;
    switch (s - GPT_BLOCK_NSLOTS) {
    case GPT_WTE:
        return t->wte;
    case GPT_WPE:
        return t->wpe;
    case GPT_LNF_W:
        return t->lnfw;
    default:
        return t->lnfb;
    }
}

/* What fetching w to tier allocates there: every member not homed there, rounded as the
 * tiers allocate. */
static uint64_t wave_need(const struct trainer *t, const struct wave *w, enum zinf_tier tier)
{
    uint64_t need = 0;
    for (int i = 0; i < w->n; i++)
        if (role_home(t, (enum role)w->role[i], w->idx[i]) != tier)
            need += align_up(role_bytes(t, (enum role)w->role[i], w->idx[i]), ZINF_ALIGN);
    return need;
}

/* The smallest capacity of each memory tier with which every step runs: the homes it
 * keeps for good plus the largest set a step fetches to it; *what[tier] names that set. */
static void min_budgets(struct trainer *t, uint64_t need[MEM_TIERS], uint64_t homes[MEM_TIERS],
                        const char *what[MEM_TIERS])
{
    static const enum role kinds[] = {R_P, R_G, R_M, R_V, R_W};
    struct wave w;
    for (int k = 0; k < MEM_TIERS; k++) {
        need[k] = homes[k] = 0;
        what[k] = NULL;
    }
    for (int i = 0; i < t->ntensors; i++)
        for (size_t j = 0; j < sizeof(kinds) / sizeof(kinds[0]); j++) {
            if (kinds[j] == R_W && t->w == t->p) continue;
            enum zinf_tier h = role_home(t, kinds[j], i);
            if (h < MEM_TIERS) homes[h] += align_up(role_bytes(t, kinds[j], i), ZINF_ALIGN);
        }
    homes[ZINF_TIER_HOST] +=
        (uint64_t)(t->cfg.L + 1) * align_up(role_bytes(t, R_ACT, 0), ZINF_ALIGN);
    for (int s = 0; s < NLOCAL; s++) {
        int i = slot_tensor(t, s);
        if (t->exact)
            homes[ZINF_TIER_DEVICE] += (s < GPT_BLOCK_NSLOTS && lg_set(t, 1) ? 2 : 1) *
                                       align_up(role_bytes(t, R_L, i), ZINF_ALIGN);
        if (stage_of(t, i) >= 3)
            homes[ZINF_TIER_DEVICE] += (s < GPT_BLOCK_NSLOTS && gw_set(t, 1) ? 2 : 1) *
                                       align_up(role_bytes(t, R_GW, i), ZINF_ALIGN);
    }
    enum zinf_tier sh = home_of(t->zc.zero.offload_param.device);
    if (sh < MEM_TIERS)
        homes[sh] +=
            align_up(sizeof(struct train_state), ZINF_ALIGN) +
            (t->be->wdt == BACKEND_F16 ? align_up(sizeof(struct loss_scale), ZINF_ALIGN) : 0);

#define CONSIDER(tier)                                                                             \
    do {                                                                                           \
        uint64_t n_ = wave_need(t, &w, (tier));                                                    \
        if (n_ > need[(tier)]) {                                                                   \
            need[(tier)] = n_;                                                                     \
            what[(tier)] = w.what;                                                                 \
        }                                                                                          \
    } while (0)
    t->budgeting = true;
    wave_embed_forward(t, &w);
    CONSIDER(ZINF_TIER_DEVICE);
    for (int k = 0; k < t->cfg.L; k++) {
        wave_block_forward(t, k, &w);
        CONSIDER(ZINF_TIER_DEVICE);
        wave_block_backward(t, k, &w);
        CONSIDER(ZINF_TIER_DEVICE);
    }
    wave_head(t, &w);
    CONSIDER(ZINF_TIER_DEVICE);
    wave_embed_backward(t, &w);
    CONSIDER(ZINF_TIER_DEVICE);
    for (int i = 0; i < t->ntensors; i++) {
        wave_optimizer(t, i, &w);
        CONSIDER(t->opt_tier);
    }
    if (t->o.sample) {
        wave_sample(t, &w);
        CONSIDER(ZINF_TIER_HOST);
    }
#undef CONSIDER
    t->budgeting = false;
    for (int k = 0; k < MEM_TIERS; k++)
        need[k] += homes[k];
}

/* Refuse, before anything runs, budgets with which a step could not run, naming the
 * smallest ones that would (zinf.device_bytes and zinf.host_bytes take them as they are). */
static int check_budgets(struct trainer *t, char *err, size_t errlen)
{
    static const char *const key[MEM_TIERS] = {"zinf.device_bytes", "zinf.host_bytes"};
    static const char *const where[MEM_TIERS] = {"the device", "the host tier"};
    uint64_t need[MEM_TIERS], homes[MEM_TIERS];
    const char *what[MEM_TIERS];
    struct zinf_stats st;
    size_t len = 0;

    min_budgets(t, need, homes, what);
    t->min_budget[ZINF_TIER_DEVICE] = need[ZINF_TIER_DEVICE];
    t->min_budget[ZINF_TIER_HOST] = need[ZINF_TIER_HOST];
    zinf_stats(t->e, &st);
    err[0] = '\0';
    for (int k = 0; k < MEM_TIERS; k++) {
        uint64_t cap = st.tier[k].capacity_bytes;
        char a[32], b[32], c[32], d[32];
        if (cap >= need[k] || len >= errlen) continue;
        char pins[160] = "", homed[96] = "";
        if (what[k])
            snprintf(pins, sizeof(pins), "%s pins %s on %s at once", what[k],
                     format_size(need[k] - homes[k], c, sizeof(c)), where[k]);
        if (homes[k])
            snprintf(homed, sizeof(homed), "%s%s of tensors are homed there", what[k] ? ", " : "",
                     format_size(homes[k], d, sizeof(d)));
        len += (size_t)snprintf(
            err + len, errlen - len, "%s%s: %s is too small: %s%s; %s (%llu bytes) runs",
            len ? "; " : "", key[k], format_size(cap, a, sizeof(a)), pins, homed,
            format_size(need[k], b, sizeof(b)), (unsigned long long)need[k]);
    }
    if (!len) return 0;
    if (len < errlen)
        snprintf(err + len, errlen - len,
                 ". The smallest budgets that run this model and batch: \"zinf\": "
                 "{\"device_bytes\": %llu, \"host_bytes\": %llu} (or shrink --dim, --batch or "
                 "--seq)",
                 (unsigned long long)need[ZINF_TIER_DEVICE],
                 (unsigned long long)need[ZINF_TIER_HOST]);
    return -EINVAL;
}

static int reg(struct trainer *t, const char *prefix, const char *name, size_t bytes,
               enum zinf_tier home, zinf_tensor *out)
{
    char full[96];
    snprintf(full, sizeof(full), "%s%s", prefix, name);
    if (t->o.resume) return zinf_lookup(t->e, full, out);
    zinf_tensor old;
    int r;
    /* Through the daemon, --overwrite starts the job over one tensor at a time. */
    if (t->remote && t->o.overwrite && zinf_lookup(t->e, full, &old) == 0 &&
        (r = zinf_unregister(t->e, old)) < 0)
        return r;
    return zinf_register(t->e, full, bytes, home, out);
}

/* A resumed tensor's home is the saved run's: it must be where this run's budget check
 * put it (the offload devices and the persistence threshold decide). */
static int check_home(struct trainer *t, zinf_tensor h, enum zinf_tier want, const char *name,
                      char *err, size_t errlen)
{
    static const char *const tiers[] = {"the device", "the host", "NVMe"};
    if (t->remote) return 0; /* the daemon's engine is not ours to look into: its job is trusted */
    struct zinf_tensor_info ti;
    enum zinf_tier got = zinf_tensor_info(t->e, h, &ti) == 0 ? ti.home : want;
    if (got == want) return 0;
    snprintf(err, errlen,
             "--resume: the saved run keeps '%s' on %s, this config on %s: give "
             "the saved run's offload devices and stage3_param_persistence_threshold",
             name, tiers[got], tiers[want]);
    return -EINVAL;
}

#define SCRATCH_KINDS 4

/* Local slot s's buffer of kind k (0: local gradients when exact, 1: gathered weights in
 * stage 3, 2: the odd blocks' gathered weights, 3: the odd blocks' local gradients with
 * overlap_comm): its name, and its handle and size; NULL when this run has none (name is
 * written all the same). */
static zinf_tensor *scratch(struct trainer *t, int s, int k, char name[64], size_t *bytes)
{
    static const char *const kind[SCRATCH_KINDS] = {"zero.grad.", "zero.gather.",
                                                    "zero.gather1.", "zero.grad1."};
    int i = slot_tensor(t, s);
    snprintf(name, 64, "%s%s", kind[k],
             s < GPT_BLOCK_NSLOTS ? gpt_block_slot_name(s) : t->desc[i].name);
    bool block = s < GPT_BLOCK_NSLOTS;
    bool has = k == 0   ? t->exact
               : k == 3 ? block && lg_set(t, 1)
                        : stage_of(t, i) >= 3 && (k == 1 || (block && gw_set(t, 1)));
    if (!has) return NULL;
    *bytes = role_bytes(t, k == 0 || k == 3 ? R_L : R_GW, i);
    return k == 0 ? &t->lg[s] : k == 1 ? &t->gw[s] : k == 2 ? &t->gw1[s] : &t->lg1[s];
}

/* Before a checkpoint, the scratch buffers are registered afresh (reading as zeros), so that
 * the swap files never hold what a step rebuilds. */
static int scratch_reset(struct trainer *t)
{
    int r = 0;
    t->gw_holds[0] = t->gw_holds[1] = -1;
    for (int s = 0; s < NLOCAL && r == 0; s++)
        for (int k = 0; k < SCRATCH_KINDS && r == 0; k++) {
            char name[64];
            size_t bytes;
            zinf_tensor *h = scratch(t, s, k, name, &bytes);
            if (h && (r = zinf_unregister(t->e, *h)) == 0)
                r = zinf_register(t->e, name, bytes, ZINF_TIER_DEVICE, h);
        }
    return r;
}

static int register_all(struct trainer *t, char *err, size_t errlen)
{
    size_t act = (size_t)t->o.batch * t->o.seq * t->cfg.C * backend_dtype_bytes(t->be->adt);
    bool mixed = t->w != t->p;
    char name[32];
    int r = 0;

    /* In fp32 the parameters the device computes with are the master weights, homed with
     * the parameters; in bf16 the bf16 copies are, and the fp32 masters are optimizer state. */
    static const enum role kinds[] = {R_P, R_G, R_M, R_V, R_W};
    static const char *const prefix[] = {"p.", "g.", "m.", "v.", "w."};
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        const char *n = t->desc[i].name;
        zinf_tensor *out[] = {&t->p[i], &t->g[i], &t->m[i], &t->v[i], &t->w[i]};
        size_t bytes = 0;
        for (int k = 0; k < (mixed ? 5 : 4) && r == 0; k++) {
            enum zinf_tier home = role_home(t, kinds[k], i);
            bytes = role_bytes(t, kinds[k], i);
            r = reg(t, prefix[k], n, bytes, home, out[k]);
            if (r == 0 && t->o.resume) {
                char full[96];
                snprintf(full, sizeof(full), "%s%s", prefix[k], n);
                if ((r = check_home(t, *out[k], home, full, err, errlen)) < 0) return r;
            }
        }
        if (r < 0 && t->o.resume)
            snprintf(err, errlen,
                     "--resume: tensor '%s' is not in the swap directory: is it the "
                     "saved run's, with the same model?",
                     n);
        else if (r < 0)
            snprintf(err, errlen, "tensor '%s' (%zu bytes): %s", n, bytes, zinf_strerror(r));
    }
    for (int k = 0; k <= t->cfg.L && r == 0; k++) {
        snprintf(name, sizeof(name), "%d", k);
        /* Activations are rebuilt every step; a resumed run finds the last ones (the flush
         * keeps every tensor) and overwrites them. */
        char full[48];
        snprintf(full, sizeof(full), "act.%s", name);
        r = t->o.resume ? zinf_lookup(t->e, full, &t->act[k]) : -ENOENT;
        if (r == -ENOENT)
            r = t->o.resume ? zinf_register(t->e, full, act, ZINF_TIER_HOST, &t->act[k])
                            : reg(t, "act.", name, act, ZINF_TIER_HOST, &t->act[k]);
        if (r < 0)
            snprintf(err, errlen, "activation checkpoint %d (%zu bytes) in the host tier: %s", k,
                     act, zinf_strerror(r));
    }
    /* The local gradients and gathered weights: working memory on the device tier, found
     * again on a resume like the activations. */
    for (int s = 0; s < NLOCAL && r == 0; s++) {
        for (int k = 0; k < SCRATCH_KINDS && r == 0; k++) {
            char full[64];
            size_t bytes;
            zinf_tensor *out = scratch(t, s, k, full, &bytes), old;
            if (!out) {
                /* A saved run's buffer this run does not use (other settings) would hold
                 * device memory the budget check did not count. */
                if (t->o.resume && zinf_lookup(t->e, full, &old) == 0)
                    r = zinf_unregister(t->e, old);
                continue;
            }
            r = t->o.resume ? zinf_lookup(t->e, full, out) : -ENOENT;
            if (r == -ENOENT)
                r = t->o.resume ? zinf_register(t->e, full, bytes, ZINF_TIER_DEVICE, out)
                                : reg(t, "", full, bytes, ZINF_TIER_DEVICE, out);
            if (r < 0)
                snprintf(err, errlen, "%s (%zu bytes) on the device tier: %s", full, bytes,
                         zinf_strerror(r));
        }
    }
    if (r == 0) {
        r = reg(t, "", STATE_NAME, sizeof(struct train_state),
                home_of(t->zc.zero.offload_param.device), &t->state);
        if (r < 0)
            snprintf(err, errlen, "%s: %s", STATE_NAME,
                     t->o.resume ? "no training state to resume in the swap directory"
                                 : zinf_strerror(r));
    }
    if (r == 0 && t->world > 1) {
        /* The partition the saved run was cut by: another would read shards as others. */
        struct zero_state z = {.magic = ZERO_MAGIC,
                               .world = t->world,
                               .stage = t->stage,
                               .rank = t->rank,
                               .persist = (int32_t)MIN(t->persist_below, (uint64_t)INT32_MAX)},
                          saved;
        r = reg(t, "", ZERO_NAME, sizeof(z), home_of(t->zc.zero.offload_param.device),
                &t->zstate);
        if (r == 0 && t->o.resume && (r = zinf_read(t->e, t->zstate, 0, &saved, sizeof(saved))) == 0 &&
            (saved.magic != ZERO_MAGIC || saved.world != z.world || saved.stage != z.stage ||
             saved.rank != z.rank)) {
            /* (Another persistence threshold moves the small weights' homes: check_home()
             * has refused it by now.) */
            snprintf(err, errlen,
                     "--resume: the saved run was cut for %d ranks at ZeRO stage %d (this is rank "
                     "%d of it); this run is %d ranks at stage %d: give the saved run's",
                     saved.world, saved.stage, saved.rank, z.world, z.stage);
            return -EINVAL;
        }
        if (r == 0 && !t->o.resume) r = zinf_write(t->e, t->zstate, 0, &z, sizeof(z));
        if (r < 0) snprintf(err, errlen, "%s: %s", ZERO_NAME, zinf_strerror(r));
    }
    if (r == 0 && t->be->wdt == BACKEND_F16) {
        /* The loss scaler goes on where the saved run left it. */
        r = reg(t, "", SCALER_NAME, sizeof(struct loss_scale),
                home_of(t->zc.zero.offload_param.device), &t->scaler);
        if (r == 0 && t->o.resume) r = zinf_read(t->e, t->scaler, 0, &t->ls, sizeof(t->ls));
        if (r < 0) snprintf(err, errlen, "%s: %s", SCALER_NAME, zinf_strerror(r));
    }
    return r;
}

static int init_params(struct trainer *t)
{
    float *buf = NULL;
    uint16_t *b16 = NULL;
    size_t cap = 0;
    int r = 0;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        size_t n = t->desc[i].numel;
        bool shard = stage_of(t, i) >= 3;
        if (shard) n = MAX(n, shard_lo(t, i) + shard_of(t, i)); /* room for the shard */
        if (n > cap) {
            free(buf);
            free(b16);
            buf = malloc(n * sizeof(float));
            b16 = malloc(n * sizeof(uint16_t));
            cap = n;
            if (!buf || !b16) {
                r = -ENOMEM;
                break;
            }
        }
        r = gpt_init_tensor(&t->cfg, &t->desc[i], buf, t->o.seed);
        if (r == 0 && shard) {
            /* The rank's shard of the whole tensor's values, zeros past its end. */
            size_t lo = shard_lo(t, i), own = shard_own(t, i);
            memmove(buf, buf + lo, own * sizeof(float));
            memset(buf + own, 0, (shard_of(t, i) - own) * sizeof(float));
            r = zinf_write(t->e, t->p[i], 0, buf, shard_of(t, i) * sizeof(float));
            continue;
        }
        if (r == 0) r = zinf_write(t->e, t->p[i], 0, buf, n * sizeof(float));
        if (r == 0 && t->w != t->p) {
            if (t->be->wdt == BACKEND_F16)
                ops_cast_f32_to_f16(b16, buf, n);
            else
                ops_cast_f32_to_bf16(b16, buf, n);
            r = zinf_write(t->e, t->w[i], 0, b16, n * sizeof(uint16_t));
        }
    }
    free(buf);
    free(b16);
    return r;
}

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

static int state_check(struct trainer *t, char *err, size_t errlen)
{
    struct train_state s;
    int r = zinf_read(t->e, t->state, 0, &s, sizeof(s));
    if (r < 0) return r;
    return state_validate(t, s, t->world, err, errlen);
}

static int state_save_step(struct trainer *t, int step_done)
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
    return state_save_step(t, t->step_done);
}

/* Several ranks (zinf launch): check what this version partitions (the CPU backend, fp32,
 * each rank an engine of its own), give each rank a swap directory of its own (rank-R under
 * each nvme path) and meet the other ranks. One rank: nothing but exact accumulation,
 * where it is needed. */
/* Where rank `rank` of `world` keeps its swap files under base (malloc'd; NULL: no memory). */
static char *rank_dir(const char *base, int world, int rank)
{
    char *d = NULL;
    if (world <= 1) return strdup(base);
    return asprintf(&d, "%s/rank-%d-of-%d", base, rank, world) < 0 ? NULL : d;
}

static int zero_setup(struct trainer *t, bool cuda, char *err, size_t errlen)
{
    const struct trainer_opts *o = &t->o;
    t->world = o->world > 1 ? o->world : 1;
    t->rank = t->world > 1 ? o->rank : 0;
    t->exact = t->world > 1 || (o->grad_accum > 1 && !cuda);
    if (t->world == 1) {
        for (unsigned k = 0; k < t->zc.nvme_paths.count; k++)
            if (!(t->base[t->nbase++] = strdup(t->zc.nvme_paths.path[k]))) return -ENOMEM;
        return 0;
    }
    t->stage = MAX(1, t->zc.zero.stage);
    if (o->rank < 0 || o->rank >= o->world || o->world > COMM_MAX_RANKS) {
        snprintf(err, errlen, "RANK %d is not in [0, WORLD_SIZE %d) (or WORLD_SIZE is above %d)",
                 o->rank, o->world, COMM_MAX_RANKS);
        return -EINVAL;
    }
    const char *why = NULL;
    if (!o->comm_name || !o->comm_name[0])
        why = "no rendezvous name (ZINF_COMM_NAME): start the ranks with zinf launch";
    else if (cuda)
        why = "training across ranks runs on the CPU in this version (zinf.device \"emulated\"); "
              "on a GPU, run one rank";
    else if (t->be->wdt != BACKEND_F32)
        why = "training across ranks runs in fp32 in this version: give --precision fp32";
    else if (o->sample && t->stage >= 3)
        why = "sampling reads whole parameters, which ZeRO stage 3 does not keep: use stage 1 or 2, "
              "or sample from one rank";
    if (why) {
        snprintf(err, errlen, "WORLD_SIZE %d: %s", t->world, why);
        return -ENOTSUP;
    }
    for (unsigned k = 0; k < t->zc.nvme_paths.count && !t->remote; k++) {
        char *mine = rank_dir(t->zc.nvme_paths.path[k], t->world, t->rank);
        if (!mine) return -ENOMEM;
        t->base[t->nbase++] = t->zc.nvme_paths.path[k];
        t->zc.nvme_paths.path[k] = mine;
        if (k) t->zc.nvme_paths_extra[k - 1] = mine;
    }
    /* overlap_comm (DeepSpeed's default: on at stage 3 only) reduces a block at a time
     * behind the next block's backward, in a second set of local gradients: the block's
     * gradients must fit in reduce_bucket_size. */
    bool want = config_given(&t->zc, "zero_optimization.overlap_comm") ? t->zc.zero.overlap_comm
                                                                       : t->stage >= 3;
    uint64_t block = gpt_block_num_params(&t->cfg);
    t->overlap = want && block <= t->zc.zero.reduce_bucket_size;
    if (want && !t->overlap && t->rank == 0)
        log_notice("zero_optimization.overlap_comm: a block's gradients (%llu elements) exceed "
                   "reduce_bucket_size (%llu): they are reduced after the block's backward",
                   (unsigned long long)block, (unsigned long long)t->zc.zero.reduce_bucket_size);
    char cwhy[400] = "";
    struct comm_opts co = {
        .backend = COMM_SHM,
        .rank = t->rank,
        .world = t->world,
        .name = o->comm_name,
        .secret = o->comm_secret,
        .timeout_ms = o->comm_timeout_ms,
        .op_timeout_ms = o->comm_op_timeout_ms ? o->comm_op_timeout_ms
                                               : t->zc.zinf.comm_timeout * 1000u,
        .stop = o->stop,
        .why = cwhy,
        .why_len = sizeof(cwhy)};
    int r = comm_open(&co, &t->comm);
    if (r < 0) {
        snprintf(err, errlen, "rank %d of %d: the ranks could not meet as '%s': %s%s", t->rank,
                 t->world, o->comm_name, cwhy[0] ? cwhy : zinf_strerror(r),
                 r == -ETIMEDOUT ? " (a rank did not start, or failed before it met the others)"
                                 : "");
        return r;
    }
    return 0;
}

/* The buffers of exact accumulation and of the collectives, once the layout is known. */
static int zero_alloc(struct trainer *t)
{
    if (!t->exact) return 0;
    if (t->ntensors < 1) return -EINVAL;
    size_t sh = 0;
    t->part_first = calloc((size_t)t->ntensors, sizeof(size_t));
    if (!t->part_first) return -ENOMEM;
    for (int i = 0; i < t->ntensors; i++) {
        t->part_first[i] = t->nparts;
        t->nparts += (t->desc[i].numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
        sh = MAX(sh, shard_of(t, i));
    }
    t->part = calloc(t->nparts, sizeof(double));
    t->part_all = calloc(t->nparts * (size_t)t->world, sizeof(double));
    t->losses = calloc((size_t)t->o.grad_accum * (size_t)(t->world + 1), sizeof(float));
    t->tmp = t->world > 1 ? calloc(sh * (size_t)(t->world + 1), sizeof(float)) : NULL;
    return t->part && t->part_all && t->losses && (t->world == 1 || t->tmp) ? 0 : -ENOMEM;
}

/* A resume across ranks: every rank's saved run must be at the same step (a checkpoint
 * that one rank finished and another did not is no state to go on from). */
static int ranks_agree(struct trainer *t, char *err, size_t errlen)
{
    int32_t mine = t->step_done, all[COMM_MAX_RANKS];
    int r = comm_allgather(t->comm, &mine, all, sizeof(mine), COMM_BYTE);
    if (r < 0) {
        snprintf(err, errlen, "--resume: the ranks could not compare their steps: %s",
                 zinf_strerror(r));
        return r;
    }
    for (int q = 0; q < t->world; q++)
        if (all[q] != all[0]) {
            snprintf(err, errlen,
                     "--resume: the ranks' saved runs are at different steps (rank 0 at %d, "
                     "rank %d at %d): a checkpoint was cut short on some; nothing resumes "
                     "from this",
                     all[0], q, all[q]);
            return -EINVAL;
        }
    return 0;
}

bool trainer_any_rank(struct trainer *t, bool mine)
{
    if (t->world <= 1) return mine;
    uint8_t me = mine, all[COMM_MAX_RANKS];
    if (comm_allgather(t->comm, &me, all, 1, COMM_BYTE) < 0) return true;
    for (int q = 0; q < t->world; q++)
        if (all[q]) return true;
    return false;
}

/* ---- resuming on another number of ranks ------------------------------------------ */

/* The newest step that every one of the `world` ranks saved under base holds, as its
 * current version or the previous one (a checkpoint that some ranks committed and others
 * did not); -1 when some rank holds none of the others' (or nothing), -2 for a run saved
 * before checkpoints were tagged with their step (every rank's manifest untagged). *newest
 * receives the newest step any rank holds. */
static int64_t common_step(const char *base, int world, int64_t *newest)
{
    int64_t tags[COMM_MAX_RANKS][2];
    int untagged = 0;
    *newest = -1;
    for (int q = 0; q < world; q++) {
        char *d = rank_dir(base, world, q);
        int r = d ? zinf_saved_steps(d, tags[q]) : -ENOMEM;
        free(d);
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
static int newest_run(const struct trainer *t, int64_t *step, int64_t *newest_any)
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
        char *r0 = rank_dir(t->base[0], n, 0);
        int sr = r0 ? zinf_saved_at(r0, &when) : -ENOMEM;
        free(r0);
        if (sr < 0) continue;
        int64_t top, c = common_step(t->base[0], n, &top);
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

/* The open flag that reaches step in swap directory dir: its current version, or the
 * previous one (ZINF_OPEN_PREVIOUS); -ENOENT where it holds neither at that step. */
static int version_flag(const char *dir, int64_t step, unsigned *flag)
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
        if (!(dirs[k] = rank_dir(t->base[k], world, q))) r = -ENOMEM;
        c.nvme_paths.path[k] = dirs[k];
        if (k) c.nvme_paths_extra[k - 1] = dirs[k];
    }
    if (r == 0) r = version_flag(dirs[0], t->resume_step, &flag);
    if (r == 0) r = zinf_open_parsed(&c, ZINF_OPEN_READONLY | ZINF_OPEN_NO_PIN | flag, out);
    for (unsigned k = 0; k < t->nbase; k++)
        free(dirs[k]);
    return r;
}

/* Before anything is written: the saved run of src_world ranks must be this model's, data's
 * and global batch's; its stage and step are taken from its rank 0. */
static int recut_check(struct trainer *t, char *err, size_t errlen)
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

/* Re-cut: every rank of the saved run in turn, the part of each parameter and Adam state
 * this rank keeps is read from the shards that hold it and written into this run's tensors;
 * then the saved step goes on. Memory: one tensor's worth of floats at a time. */
static int recut(struct trainer *t, char *err, size_t errlen)
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
                bool to_shard = role_bytes(t, roles[k], i) < n * sizeof(float);
                if (!from_shard && q != 0) continue; /* whole in every rank: rank 0's */
                size_t s_lo = from_shard ? (size_t)q * ssh : 0;
                size_t s_hi = from_shard ? MIN(n, s_lo + ssh) : n;
                size_t d_lo = to_shard ? shard_lo(t, i) : 0;
                size_t d_hi = to_shard ? d_lo + shard_own(t, i) : n;
                size_t a = MAX(s_lo, d_lo), b = MIN(s_hi, d_hi);
                if (a >= b) continue;
                char name[96];
                snprintf(name, sizeof(name), "%s%s", prefix[k], t->desc[i].name);
                zinf_tensor dst = wave_handle(t, roles[k], i);
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
    return r < 0 ? r : state_save_step(t, t->step_done);
}

int trainer_open(const struct trainer_opts *o, struct trainer **out, char *err, size_t errlen)
{
    struct trainer *t;
    int r;

    *out = NULL;
    err[0] = '\0';
    if (o->model.V != 256) {
        snprintf(err, errlen, "the vocabulary is bytes: V must be 256");
        return -EINVAL;
    }
    if (o->batch < 1 || o->seq < 1 || o->steps < 0 || !(o->lr >= 0) || !(o->grad_clip >= 0)) {
        snprintf(err, errlen, "--batch and --seq must be >= 1, --steps >= 0, --lr >= 0");
        return -EINVAL;
    }
    if (o->grad_accum < 1 || !(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) ||
        !(o->eps > 0) || !(o->weight_decay >= 0)) {
        snprintf(err, errlen,
                 "the gradient accumulation steps must be >= 1, Adam's betas in "
                 "[0, 1), eps > 0 and the weight decay >= 0");
        return -EINVAL;
    }
    if ((o->sched.type == TRAINER_SCHED_WARMUP_DECAY ||
         o->sched.type == TRAINER_SCHED_WARMUP_COSINE) &&
        o->sched.total_steps < 1) {
        snprintf(err, errlen, "scheduler.params.total_num_steps: %s needs it (>= 1)",
                 o->sched.type == TRAINER_SCHED_WARMUP_DECAY ? "WarmupDecayLR" : "WarmupCosineLR");
        return -EINVAL;
    }
    struct gpt_config cfg = o->model;
    cfg.maxT = o->seq;
    if (gpt_config_validate(&cfg, err, errlen) < 0) return -EINVAL;
    if (!o->config_path || !o->data_path) {
        snprintf(err, errlen, "--config FILE and --data FILE are required");
        return -EINVAL;
    }

    t = calloc(1, sizeof(*t));
    if (!t) return -ENOMEM;
    pthread_mutex_init(&t->gmu, NULL);
    pthread_cond_init(&t->gcv, NULL);
    t->gw_holds[0] = t->gw_holds[1] = -1;
    t->resume_step = -1;
    const char *ka = getenv("ZINF_TEST_KILL_AT");
    if (ka && sscanf(ka, "%31[a-z-]:%d:%d", t->kill_point, &t->kill_rank, &t->kill_nth) != 3)
        t->kill_point[0] = 0;
    t->o = *o;
    t->cfg = cfg;
    config_defaults(&t->zc);
    if ((r = config_parse_file(o->config_path, &t->zc, err, errlen)) < 0) goto fail;
    /* "auto" (Hugging Face's configs) as the command resolved it: the engine's prefetch
     * budget comes from the model's width. */
    struct config_auto_inputs ai = {.hidden_size = o->model.C,
                                    .micro_batch = o->batch,
                                    .grad_accum = o->grad_accum,
                                    .steps = o->steps,
                                    .lr = o->lr,
                                    .weight_decay = o->weight_decay,
                                    .grad_clip = o->grad_clip,
                                    .bf16 = -1};
    char resolved[1024];
    config_resolve_auto(&t->zc, &ai, resolved, sizeof(resolved));
    /* DeepSpeed's persistent parameters, when the config sets the threshold ("auto": ten
     * times the width); without it every weight stays in its offload home. */
    if (config_given(&t->zc, "zero_optimization.stage3_param_persistence_threshold"))
        t->persist_below = t->zc.zero.stage3_param_persistence_threshold;
    /* Through the daemon (--connect, zinf.connect): its job's device tier is emulated in
     * memory it shares with this process, so the math runs on the CPU. */
    if (!t->o.connect && t->zc.zinf.connect.count) t->o.connect = t->zc.zinf.connect.path[0];
    if (!t->o.job) t->o.job = t->zc.zinf.job[0] ? t->zc.zinf.job : TRAINER_DEFAULT_JOB;
    t->remote = t->o.connect != NULL;
    if (t->remote) t->zc.zinf.device = ZINF_DEVICE_EMULATED;
    /* The device tier and the backend go together: the CUDA kernels where the tier is a
     * GPU, the CPU over the emulated tier otherwise. */
    bool cuda = false;
    if (t->zc.zinf.device != ZINF_DEVICE_EMULATED) {
        struct cuda_probe_info ci = {0};
        bool built = backend_cuda_built(), usable = built && cuda_probe(&ci) > 0;
        if (t->zc.zinf.device == ZINF_DEVICE_CUDA && !usable) {
            snprintf(err, errlen, "zinf.device is \"cuda\" but %s; use \"auto\" or \"emulated\"",
                     !built ? "this build has no CUDA kernels (no CUDA toolkit when it was built)"
                     : ci.reason[0] ? ci.reason
                                    : "no GPU is usable");
            r = -ENODEV;
            goto fail;
        }
        cuda = usable;
    }
    t->zc.zinf.device = cuda ? ZINF_DEVICE_CUDA : ZINF_DEVICE_EMULATED;
    /* The backend's working memory is taken before the engine sizes the device tier from
     * what is free. */
    struct backend_params bp = {
        .cfg = cfg,
        .B = o->batch,
        .T = o->seq,
        .wdt = o->precision == TRAINER_PRECISION_FP16   ? BACKEND_F16
               : o->precision == TRAINER_PRECISION_BF16 ? BACKEND_BF16
               : o->precision == TRAINER_PRECISION_FP32 ? BACKEND_F32
               : cuda                                   ? BACKEND_BF16
                                                        : BACKEND_F32,
        .cuda_device = t->zc.zinf.cuda_device,
    };
    r = cuda ? backend_cuda_open(&bp, &t->be, err, errlen)
             : backend_cpu_open(&bp, &t->be, err, errlen);
    if (r < 0) goto fail;
    t->opt_tier = home_of(t->zc.zero.offload_optimizer.device) == ZINF_TIER_DEVICE
                      ? ZINF_TIER_DEVICE
                      : ZINF_TIER_HOST;
    if ((r = zero_setup(t, cuda, err, errlen)) < 0) goto fail;
    if (o->resume && !t->zc.nvme_paths.count && !t->remote) {
        snprintf(err, errlen,
                 "--resume needs an NVMe swap directory in the config "
                 "(zero_optimization.offload_param.nvme_path or zinf.nvme_paths)");
        r = -EINVAL;
        goto fail;
    }
    if ((home_of(t->zc.zero.offload_param.device) == ZINF_TIER_NVME ||
         home_of(t->zc.zero.offload_optimizer.device) == ZINF_TIER_NVME) &&
        !t->zc.nvme_paths.count && !t->remote) {
        snprintf(err, errlen, "an offload device is \"nvme\" but no nvme_path is given");
        r = -EINVAL;
        goto fail;
    }
    if ((r = load_data(t, err, errlen)) < 0) goto fail;
    /* The last tenth is held out for validation when it holds a whole sequence, and the
     * rest too: batches never come from it, whether or not anything evaluates on it. */
    t->train_bytes = t->data_bytes;
    if (t->data_bytes / HELD_OUT_DIVISOR >= (size_t)o->seq + 1)
        t->train_bytes = t->data_bytes - t->data_bytes / HELD_OUT_DIVISOR;
    /* The swap directory is the user's: a saved run there is continued (--resume) or
     * deleted on request (--overwrite), never by default. The engine refuses the same, in
     * the library's words; this says it in the command's. (The engine creates a missing
     * directory, with its parents, for a new run.) */
    if (t->zc.nvme_paths.count && !t->remote) {
        const char *sd = t->zc.nvme_paths.path[0];
        size_t n = 0;
        int pr = zinf_saved_tensors(sd, &n);
        /* A run saved by another number of ranks, newer than any of this one's: rank 0
         * looks, and every rank goes by what it found. */
        int64_t found[3] = {0, -1, -1}; /* ranks, the step every rank holds, the newest */
        if (t->rank == 0) found[0] = newest_run(t, &found[1], &found[2]);
        if (t->world > 1 && (r = comm_broadcast(t->comm, found, sizeof(found), COMM_BYTE, 0)) < 0) {
            snprintf(err, errlen, "rank %d: the ranks could not agree on the saved run: %s",
                     t->rank, zinf_strerror(r));
            goto fail;
        }
        int32_t nw = (int32_t)found[0];
        t->resume_step = found[1];
        bool other = nw && nw != t->world;
        if (o->resume && nw && t->rank == 0 && found[2] > found[1] && found[1] >= 0)
            log_notice("--resume: rolling back %lld step%s to step %lld, the newest that every "
                       "one of the %d rank%s saved: the checkpoint of step %lld was not completed "
                       "by every rank",
                       (long long)(found[2] - found[1]), found[2] - found[1] == 1 ? "" : "s",
                       (long long)found[1], nw, nw > 1 ? "s" : "", (long long)found[2]);
        if (o->resume && !nw && t->world > 1 && pr == 0 && n > 0) {
            /* What each rank holds, said by every rank the same. */
            int k = snprintf(err, errlen, "--resume: no step is saved by every one of the %d "
                             "ranks under %s:", t->world, t->base[0]);
            for (int q = 0; q < t->world && k > 0 && (size_t)k < errlen; q++) {
                int64_t tags[2] = {-1, -1};
                char *rd = rank_dir(t->base[0], t->world, q);
                if (rd) zinf_saved_steps(rd, tags);
                free(rd);
                char held[64] = "no step";
                if (tags[0] >= 0 && tags[1] >= 0)
                    snprintf(held, sizeof(held), "steps %lld and %lld", (long long)tags[0],
                             (long long)tags[1]);
                else if (tags[0] >= 0)
                    snprintf(held, sizeof(held), "step %lld", (long long)tags[0]);
                k += snprintf(err + k, errlen - (size_t)k, "%s rank %d holds %s", q ? "," : "", q,
                              held);
            }
            r = -EINVAL;
            goto fail;
        }
        if (o->resume && other) {
            t->src_world = nw;
            t->o.resume = false; /* this rank's tensors are new, filled by recut() */
            if ((r = recut_check(t, err, errlen)) < 0) goto fail;
        } else if (o->resume && pr == -ENOENT) {
            snprintf(err, errlen, "--resume: no saved run in %s", sd);
            r = -ENOENT;
            goto fail;
        }
        if (!o->resume && !o->overwrite && ((pr == 0 && n > 0) || other)) {
            char by[64] = "";
            if (other)
                snprintf(by, sizeof(by), nw > 1 ? " (by %d ranks)" : " (by one rank)", nw);
            snprintf(err, errlen,
                     "%s holds a saved run%s: continue it with --resume, or start "
                     "over with --overwrite (which deletes %s)",
                     other ? t->base[0] : sd, by, other ? "this run's own" : "it");
            r = -EEXIST;
            goto fail;
        }
    }

    if (t->remote) {
        /* Through the daemon, each rank is a job of its own, JOB-rank-R-of-N, all of them in
         * the daemon's one pinned pool and swap directories. */
        if (t->world > 1)
            snprintf(t->job, sizeof(t->job), "%.40s-rank-%d-of-%d", t->o.job, t->rank, t->world);
        else
            snprintf(t->job, sizeof(t->job), "%s", t->o.job);
        r = zinf_connect(t->o.connect, t->job, &t->e);
        if (r < 0) {
            snprintf(err, errlen, "cannot connect to the zinf daemon on %s (job %s): %s",
                     t->o.connect, t->job,
                     r == -ENOENT || r == -ECONNREFUSED ? "nobody listens there (zinf serve)"
                                                        : zinf_strerror(r));
            if (r == -ENOENT) r = -ECONNREFUSED; /* a daemon not running is no bad input */
            goto fail;
        }
        /* As with a swap directory: a saved run is continued or started over on request,
         * never by accident. */
        zinf_tensor st;
        bool saved = zinf_lookup(t->e, STATE_NAME, &st) == 0;
        if (o->resume && !saved) {
            snprintf(err, errlen, "--resume: job %s on %s holds no saved run%s", t->job,
                     t->o.connect,
                     t->world > 1 ? " (through the daemon, a run resumes on as many ranks as "
                                    "saved it)"
                                  : "");
            r = -ENOENT;
            goto fail;
        }
        if (!o->resume && !o->overwrite && saved) {
            snprintf(err, errlen,
                     "job %s on %s holds a saved run: continue it with --resume, "
                     "or start over with --overwrite (which deletes it)",
                     t->job, t->o.connect);
            r = -EEXIST;
            goto fail;
        }
    } else {
        unsigned flag = 0;
        /* Resuming, each rank goes to the step every rank holds: its current version, or
         * the previous one where its checkpoint of a later step was not completed by all. */
        if (t->o.resume && t->world > 1 &&
            (r = version_flag(t->zc.nvme_paths.path[0], t->resume_step, &flag)) < 0) {
            snprintf(err, errlen, "--resume: rank %d holds no step %lld in %s", t->rank,
                     (long long)t->resume_step, t->zc.nvme_paths.path[0]);
            goto fail;
        }
        r = zinf_open_parsed(&t->zc,
                             t->o.resume                      ? ZINF_OPEN_RESUME | flag
                             : o->overwrite || t->src_world ? ZINF_OPEN_OVERWRITE
                                                              : 0,
                             &t->e);
    }
    if (r < 0) {
        if (r == -EBUSY)
            snprintf(err, errlen,
                     "%s: the swap directory %s is in use by another engine (its "
                     "swap files are locked): one job per swap directory",
                     o->config_path, t->zc.nvme_paths.count ? t->zc.nvme_paths.path[0] : "");
        else
            snprintf(err, errlen, "%s: cannot open the engine: %s", o->config_path,
                     zinf_strerror(r));
        goto fail;
    }
    t->ntensors = gpt_layout(&cfg, NULL, 0);
    t->desc = calloc((size_t)t->ntensors, sizeof(*t->desc));
    t->p = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->g = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->m = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->v = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->w = t->be->wdt == BACKEND_F32 ? t->p : calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->block_first = calloc((size_t)cfg.L, sizeof(int));
    t->act = calloc((size_t)cfg.L + 1, sizeof(zinf_tensor));
    size_t bt = (size_t)o->batch * o->seq;
    t->tokens = malloc(bt * sizeof(int));
    t->targets = malloc(bt * sizeof(int));
    if (!t->desc || !t->p || !t->g || !t->m || !t->v || !t->w || !t->block_first || !t->act ||
        !t->tokens || !t->targets) {
        snprintf(err, errlen, "out of memory");
        r = -ENOMEM;
        goto fail;
    }
    gpt_layout(&cfg, t->desc, (size_t)t->ntensors);
    for (int i = 0; i < t->ntensors; i++) {
        const struct gpt_tensor_desc *d = &t->desc[i];
        if (d->block >= 0 && d->slot == 0) t->block_first[d->block] = i;
        if (d->block < 0) {
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
    if ((r = zero_alloc(t)) < 0) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    if ((r = check_budgets(t, err, errlen)) < 0) goto fail;
    /* Resuming, the saved run's shape and precision are checked before its tensors are
     * looked up, so a mismatch is named as such; without a saved state, register_all()
     * says so. */
    if (t->o.resume && zinf_lookup(t->e, STATE_NAME, &t->state) == 0 &&
        (r = state_check(t, err, errlen)) < 0)
        goto fail;
    if ((r = register_all(t, err, errlen)) < 0) goto fail;
    if (!t->o.resume && t->be->wdt == BACKEND_F16) {
        const struct trainer_fp16 *f = &o->fp16;
        loss_scale_init(&t->ls, f->loss_scale, f->initial_scale_power, f->loss_scale_window,
                        f->hysteresis, f->min_loss_scale, f->consecutive_hysteresis);
        if ((r = zinf_write(t->e, t->scaler, 0, &t->ls, sizeof(t->ls))) < 0) {
            snprintf(err, errlen, "%s: %s", SCALER_NAME, zinf_strerror(r));
            goto fail;
        }
    }
    if (t->src_world && ((r = recut(t, err, errlen)) < 0 || (r = trainer_checkpoint(t)) < 0)) {
        if (!err[0]) snprintf(err, errlen, "--resume: re-cutting the saved run: %s", zinf_strerror(r));
        t->checkpoint_failed = true; /* half a re-cut is never saved */
        goto fail;
    }
    if (!o->resume && ((r = init_params(t)) < 0 || (r = trainer_checkpoint(t)) < 0)) {
        snprintf(err, errlen, "initialising the parameters failed: %s%s", zinf_strerror(r),
                 r == -ENOSPC ? " (the swap directory's filesystem is full: see the line above)"
                              : "");
        goto fail;
    }
    if (t->world > 1 && o->resume && (r = ranks_agree(t, err, errlen)) < 0) goto fail;
    t->checkpoint_step = t->step_done;
    *out = t;
    return 0;
fail:
    trainer_close(t);
    return r;
}

void trainer_close(struct trainer *t)
{
    if (!t) return;
    /* A torn state is dropped: the last checkpoint stays the saved one, as after a crash.
     * So it does after a failed checkpoint, as the caller was told. */
    if (t->torn || t->checkpoint_failed || (t->world > 1 && !t->remote))
        zinf_close_unflushed(t->e);
    else
        zinf_close(t->e);
    config_free(&t->zc);
    free(t->desc);
    free(t->p);
    free(t->g);
    free(t->m);
    free(t->v);
    if (t->w != t->p) free(t->w);
    free(t->block_first);
    free(t->act);
    free(t->tokens);
    free(t->targets);
    free(t->part_first);
    free(t->part);
    free(t->part_all);
    free(t->losses);
    free(t->tmp);
    comm_close(t->comm);
    pthread_mutex_destroy(&t->gmu);
    pthread_cond_destroy(&t->gcv);
    for (unsigned k = 0; k < t->nbase; k++)
        free(t->base[k]);
    backend_close(t->be);
    free(t->data);
    free(t);
}

/* ---- one step -------------------------------------------------------------------------- */

#define TRY(x)                                                                                     \
    do {                                                                                           \
        if ((r = (x)) < 0) goto out;                                                               \
    } while (0)

/* The backend's queued work that reads or writes what is about to be released must be
 * done first; when it failed, r keeps the first error. */
static int settle(struct trainer *t, int r)
{
    int x = t->be->ops->sync(t->be);
    return r < 0 ? r : x;
}

static int forward(struct trainer *t)
{
    const struct backend_ops *be = t->be->ops;
    struct wave w;
    void *p[WAVE_MAX];
    int r;

    /* The weights gathered in the last step are stale: the optimizer changed the shards. */
    t->gw_holds[0] = t->gw_holds[1] = -1;
    uint64_t s0 = trace_on() ? now_ns() : 0;
    wave_embed_forward(t, &w);
    TRY(wave_fetch(t, &w, ZINF_TIER_DEVICE, p));
    r = settle(t, be->embed_forward(t->be, p[0], p[1], p[2]));
    wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
    if (s0) trace_span("train", "embeddings forward", s0, NULL, NULL, -1);
    if (r < 0) goto out;

    for (int k = 0; k < t->cfg.L; k++) {
        s0 = trace_on() ? now_ns() : 0;
        wave_block_forward(t, k, &w);
        TRY(wave_fetch(t, &w, ZINF_TIER_DEVICE, p));
        r = settle(t, be->block_forward(t->be, (const void *const *)p, p[GPT_BLOCK_NSLOTS],
                                        p[GPT_BLOCK_NSLOTS + 1]));
        int x = wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
        if (r == 0) r = x; /* the next block's gather failed */
        if (s0) trace_span_n("train", "block forward", k, s0);
        if (r < 0) goto out;
        note_peaks(t);
    }
out:
    return r;
}

/* The collective that sums this micro-batch's gradient of tensor i over the ranks, in rank
 * order (l: world x shard floats, on the device tier): from stage 2 a reduce-scatter into
 * this rank's shard, else an allreduce. On the step's first micro-batch it writes g itself;
 * on the others it works in place in l, and fold_grad adds the result (q->recv, q->count
 * floats) to g. */
static void reduce_req(struct trainer *t, int i, float *l, float *g, struct comm_req *q)
{
    size_t sh = shard_of(t, i);
    bool first = t->micro == 0, scatter = stage_of(t, i) >= 2;
    *q = (struct comm_req){.op = scatter ? COMM_REDUCE_SCATTER : COMM_ALLREDUCE,
                           .dtype = COMM_F32,
                           .send = l,
                           .recv = first ? g : scatter ? l + (size_t)t->rank * sh : l,
                           .count = scatter ? sh : t->desc[i].numel};
}

/* Add this micro-batch's gradient of tensor i (src, count floats, summed over the ranks)
 * into what the step keeps of it (g: the whole tensor, or from stage 2 this rank's shard):
 * copied on the step's first micro-batch and added on the others. On the last, the squares
 * of the rank's part are summed by chunks of SHARD_FLOATS for the clipping norm
 * (grad_norm() adds the chunks up in the layout's order). Runs on the comm's thread for a
 * reduction behind the backward: it touches g and tensor i's chunk sums only. */
static int fold_grad(struct trainer *t, int i, const float *src, float *g, size_t count)
{
    bool first = t->micro == 0;
    int r = 0;
    if (first && src != g)
        memcpy(g, src, count * sizeof(float));
    else if (!first)
        for (size_t j = 0; j < count; j++)
            g[j] += src[j];
    size_t own = shard_own(t, i), lo = t->world > 1 ? shard_lo(t, i) : 0;
    if (t->micro == t->o.grad_accum - 1 && own) {
        const float *mine = stage_of(t, i) >= 2 ? g : g + lo;
        double *part = t->part + t->part_first[i] + lo / SHARD_FLOATS;
        for (size_t c = 0; c * SHARD_FLOATS < own && r == 0; c++)
            r = adamw_sum_squares(mine + c * SHARD_FLOATS, MIN(SHARD_FLOATS, own - c * SHARD_FLOATS),
                                  &part[c]);
    }
    return r;
}

/* Reduce tensor i's local gradient l into g now (fold_grad); one rank: fold it. */
static int reduce_grad(struct trainer *t, int i, float *l, float *g)
{
    if (t->world <= 1) return fold_grad(t, i, l, g, t->desc[i].numel);
    struct comm_req q;
    reduce_req(t, i, l, g, &q);
    uint64_t t0 = now_ns();
    int r = comm_run(t->comm, &q);
    t->reduce_ns += now_ns() - t0;
    return r < 0 ? r : fold_grad(t, i, q.recv, g, q.count);
}

/* The squared norm of the step's gradient: every chunk's sum, from the rank that owns it, in
 * the layout's order, so that any number of ranks adds the same numbers in the same order. */
static int grad_norm(struct trainer *t, double *sumsq)
{
    const double *all = t->part;
    size_t np = t->nparts;
    if (t->world > 1) {
        int r = comm_allgather(t->comm, t->part, t->part_all, np * sizeof(double), COMM_BYTE);
        if (r < 0) return r;
        all = t->part_all;
    }
    double s = 0;
    for (int i = 0; i < t->ntensors; i++) {
        size_t chunks = (t->desc[i].numel + SHARD_FLOATS - 1) / SHARD_FLOATS;
        size_t per = shard_of(t, i) / SHARD_FLOATS; /* chunks per rank */
        for (size_t c = 0; c < chunks; c++) {
            size_t owner = t->world > 1 ? c / per : 0;
            s += all[owner * np + t->part_first[i] + c];
        }
    }
    *sumsq = s;
    return 0;
}

/* The head's backward gives the loss and the first gradient. Gradients are zeroed on their
 * first touch of the step (the first micro-batch: the others add to them), and their squares
 * summed for the clipping norm on the last micro-batch, once they are whole. Exact: every
 * micro-batch's go to the local buffers (zero, no norm), which reduce folds into g. */
static int head(struct trainer *t, bool zero, bool norm, bool reduce)
{
    const struct gpt_config *c = &t->cfg;
    const struct backend_ops *be = t->be->ops;
    struct wave w;
    void *p[WAVE_MAX];
    int r;

    uint64_t s0 = trace_on() ? now_ns() : 0;
    wave_head(t, &w);
    if ((r = wave_fetch(t, &w, ZINF_TIER_DEVICE, p)) < 0) return r;
    size_t C = (size_t)c->C * sizeof(float);
    if (zero && (r = be->zero(t->be, p[4], C)) == 0 && (r = be->zero(t->be, p[5], C)) == 0)
        r = be->zero(t->be, p[6], (size_t)c->V * C);
    if (r == 0 && (r = be->head_backward(t->be, p[1], p[2], p[3], p[0], p[4], p[5], p[6])) == 0 &&
        norm && (r = be->sumsq(t->be, p[4], (size_t)c->C)) == 0)
        r = be->sumsq(t->be, p[5], (size_t)c->C);
    r = settle(t, r);
    if (r == 0 && t->exact && reduce && (r = reduce_grad(t, t->lnfw, p[4], p[7])) == 0)
        r = reduce_grad(t, t->lnfb, p[5], p[8]);
    wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
    if (s0) trace_span("train", "head (loss and its gradient)", s0, NULL, NULL, -1);
    return r;
}

static int backward(struct trainer *t, bool zero, bool norm)
{
    const struct backend_ops *be = t->be->ops;
    struct wave w;
    void *p[WAVE_MAX];
    int r = 0;

    for (int k = t->cfg.L - 1; k >= 0; k--) {
        uint64_t s0 = trace_on() ? now_ns() : 0;
        wave_block_backward(t, k, &w);
        TRY(wave_fetch(t, &w, ZINF_TIER_DEVICE, p));
        void **gw = p + GPT_BLOCK_NSLOTS, *a = p[2 * GPT_BLOCK_NSLOTS];
        size_t first = (size_t)t->block_first[k];
        for (int i = 0; i < GPT_BLOCK_NSLOTS && r == 0 && zero; i++)
            r = be->zero(t->be, gw[i], t->desc[first + i].numel * sizeof(float));
        if (r == 0) r = be->block_backward(t->be, (const void *const *)p, a, (float *const *)gw);
        for (int i = 0; i < GPT_BLOCK_NSLOTS && r == 0 && norm; i++)
            r = be->sumsq(t->be, gw[i], t->desc[first + i].numel);
        r = settle(t, r);
        for (int i = 0; i < GPT_BLOCK_NSLOTS && r == 0 && t->exact && !t->overlap; i++)
            r = reduce_grad(t, (int)first + i, gw[i], p[2 * GPT_BLOCK_NSLOTS + 1 + i]);
        int x = wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
        if (r == 0) r = x; /* a reduction behind this block failed */
        if (s0) trace_span_n("train", "block backward", k, s0);
        if (r < 0) goto out;
        note_peaks(t);
    }

    /* The embeddings: g_wte already holds the head's share. */
    uint64_t s0 = trace_on() ? now_ns() : 0;
    wave_embed_backward(t, &w);
    TRY(wave_fetch(t, &w, ZINF_TIER_DEVICE, p));
    if (zero) r = be->zero(t->be, p[1], t->desc[t->wpe].numel * sizeof(float));
    if (r == 0 && (r = be->embed_backward(t->be, p[0], p[1])) == 0 && norm &&
        (r = be->sumsq(t->be, p[0], t->desc[t->wte].numel)) == 0)
        r = be->sumsq(t->be, p[1], t->desc[t->wpe].numel);
    r = settle(t, r);
    if (r == 0 && t->exact && (r = reduce_grad(t, t->wte, p[0], p[2])) == 0)
        r = reduce_grad(t, t->wpe, p[1], p[3]);
    int x = wave_release(t, &w, ZINF_TIER_DEVICE, r == 0);
    if (r == 0) r = x;
    if (s0) trace_span("train", "embeddings backward", s0, NULL, NULL, -1);
out:
    return r;
}

/* AdamW over every tensor where the optimizer's states live: on the device with the
 * backend's fused kernel when they are homed there, else on the host. With bf16 weights the
 * update writes the bf16 copy too (released dirty: the engine carries it to the device on
 * its next fetch there). The learned schedule prefetches the next tensor's parts while this
 * one is updated. */
/* Across ranks: AdamW on the rank's part of tensor i (p[0..3]: p, g, m, v as registered),
 * then, below stage 3, every rank takes the others' parts of p. */
static int zero_update(struct trainer *t, int i, void **p, const struct adamw_hparams *h,
                       int step, float scale)
{
    size_t n = t->desc[i].numel, sh = shard_of(t, i), own = shard_own(t, i);
    size_t lo = shard_lo(t, i);
    int stage = stage_of(t, i);
    float *pp = p[0], *mine = stage >= 3 ? pp : pp + MIN(lo, n);
    const float *g = stage >= 2 ? (const float *)p[1] : (const float *)p[1] + MIN(lo, n);
    int r = own ? adamw_update(mine, g, p[2], p[3], own, h, step, scale) : 0;
    if (r < 0 || stage >= 3) return r;
    /* A whole shard is sent from where it is; one cut short by the tensor's end is padded. */
    float *send = mine, *recv = t->tmp + sh;
    if (own < sh) {
        send = t->tmp;
        memcpy(send, mine, own * sizeof(float));
        memset(send + own, 0, (sh - own) * sizeof(float));
    }
    if ((r = comm_allgather(t->comm, send, recv, sh, COMM_F32)) == 0)
        memcpy(pp, recv, n * sizeof(float));
    return r;
}

/* With trainer_opts.digest, *digest += the digest terms of tensor i's fp32 parameters as
 * the update left them: the whole tensor on one rank, the rank's own shard on several (the
 * ranks' sums are added in trainer_step). p[0] is where the update wrote. */
static int digest_tensor(struct trainer *t, int i, void **p, uint64_t *digest)
{
    size_t n = t->desc[i].numel;
    if (t->world > 1) {
        size_t own = shard_own(t, i), lo = shard_lo(t, i);
        const float *mine = stage_of(t, i) >= 3 ? (const float *)p[0] : (const float *)p[0] + lo;
        if (own) *digest += digest_floats(mine, own, (uint32_t)i, lo / DIGEST_BLOCK_FLOATS);
        return 0;
    }
    if (t->opt_tier == ZINF_TIER_DEVICE)
        return t->be->ops->digest(t->be, p[0], n, (uint32_t)i, 0, digest);
    *digest += digest_floats(p[0], n, (uint32_t)i, 0);
    return 0;
}

/* The gradients are sums over grad_accum micro-batches of every rank (times the fp16 loss
 * scale): their mean is what is clipped and applied. Returns the factor clipping multiplies
 * that mean by; *norm = its norm, *grad_scale = what the optimizer multiplies the summed
 * gradients by (with one micro-batch and no loss scale, the clip factor itself). */
static float clip_of(const struct trainer *t, double sumsq, double loss_scale, double *norm,
                     float *grad_scale)
{
    double K = (double)t->o.grad_accum * t->world * loss_scale;
    *norm = sqrt(sumsq) / K;
    float clip = adamw_clip_scale(K == 1 ? sumsq : sumsq / (K * K), t->o.grad_clip);
    *grad_scale = K == 1 ? clip : clip / (float)K;
    return clip;
}

/* The update of step `step` (Adam's count) at rate lr, the gradients times scale. */
static int optimize(struct trainer *t, int step, float lr, float scale, uint64_t *digest)
{
    struct adamw_hparams h;
    enum zinf_tier tier = t->opt_tier;
    bool mixed = t->w != t->p;
    int r = 0;

    adamw_hparams_defaults(&h);
    h.lr = lr;
    h.beta1 = t->o.beta1;
    h.beta2 = t->o.beta2;
    h.eps = t->o.eps;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        struct wave w;
        void *p[WAVE_MAX];
        uint64_t s0 = trace_on() ? now_ns() : 0;
        wave_optimizer(t, i, &w);
        if ((r = wave_fetch(t, &w, tier, p)) < 0) break;
        if (t->fault_err && i == t->fault_tensor) {
            r = -t->fault_err; /* as if fetching had failed */
            t->fault_err = 0;
        }
        if (r == 0) {
            /* Decay the matrices only, as GPT-2 trainers do (not biases, norms). */
            h.weight_decay = t->desc[i].ndim == 2 ? t->o.weight_decay : 0.0f;
            if (t->world > 1)
                r = zero_update(t, i, p, &h, step, scale);
            else if (tier == ZINF_TIER_DEVICE)
                r = settle(t, t->be->ops->adamw(t->be, p[0], p[1], p[2], p[3], mixed ? p[4] : NULL,
                                                t->desc[i].numel, &h, step, scale));
            else if (mixed && t->be->wdt == BACKEND_F16) {
                if ((r = adamw_update(p[0], p[1], p[2], p[3], t->desc[i].numel, &h, step, scale)) ==
                    0)
                    ops_cast_f32_to_f16(p[4], p[0], t->desc[i].numel);
            } else if (mixed)
                r = adamw_update_bf16(p[0], p[1], p[2], p[3], p[4], t->desc[i].numel, &h, step,
                                      scale);
            else
                r = adamw_update(p[0], p[1], p[2], p[3], t->desc[i].numel, &h, step, scale);
            if (r == 0 && t->o.digest) r = digest_tensor(t, i, p, digest);
        }
        wave_release(t, &w, tier, r == 0);
        if (s0)
            trace_span("train", "optimizer", s0, t->desc[i].name,
                       tier == ZINF_TIER_DEVICE ? "on the device" : "on the host",
                       (int64_t)role_bytes(t, R_P, i));
        note_peaks(t);
    }
    return r;
}

/* *d = the sum of every rank's *d (each rank's digest terms of its own shards). */
static int digest_across(struct trainer *t, uint64_t *d)
{
    uint64_t all[COMM_MAX_RANKS];
    int r = comm_allgather(t->comm, d, all, sizeof(uint64_t), COMM_BYTE);
    if (r == 0) {
        *d = 0;
        for (int k = 0; k < t->world; k++)
            *d += all[k];
    }
    return r;
}

int trainer_step(struct trainer *t, struct trainer_step_stats *st)
{
    struct zinf_stats s0, s1;
    int step = t->step_done + 1, r;
    float loss = 0;
    double sumsq = 0;

    if (t->torn) return t->torn;
    zinf_stats(t->e, &s0);
    uint64_t t0 = now_ns();
    double loss_sum = 0;
    bool fp16 = t->be->wdt == BACKEND_F16;
    double S = fp16 ? t->ls.scale : 1;
    t->be->loss_scale = (float)S;
    int K = t->o.grad_accum, total = K * t->world;
    for (int m = 0; m < K; m++) {
        /* Exact: every micro-batch's gradients start from zero; the reductions add them. */
        bool first = m == 0 || t->exact, last = m == K - 1 && !t->exact;
        float l;
        double ss;
        load_batch(t, step, t->rank * K + m); /* rank r's are the micro-batches after r's */
        t->micro = m;
        TRY(t->be->ops->set_batch(t->be, t->tokens, t->targets));
        TRY(forward(t));
        TRY(head(t, first, last, true));
        TRY(backward(t, first, last));
        TRY(t->be->ops->collect(t->be, &l, &ss));
        if (t->losses) t->losses[m] = l;
        loss_sum += l;
        sumsq += ss;
    }
    if (t->exact) TRY(grad_norm(t, &sumsq));
    if (t->world > 1) {
        /* Every micro-batch's loss, in the order one rank would have run them. */
        float *all = t->losses + K;
        TRY(comm_allgather(t->comm, t->losses, all, (size_t)K, COMM_F32));
        loss_sum = 0;
        for (int m = 0; m < total; m++)
            loss_sum += all[m];
    }
    loss = total == 1 ? (float)loss_sum : (float)(loss_sum / total);
    if (fp16 && t->fault_overflow) {
        sumsq = INFINITY; /* trainer_fault_overflow() */
        t->fault_overflow = false;
    }
    /* fp16: gradients that overflowed skip the update (DeepSpeed's rule); Adam and the
     * schedule count the steps applied. */
    bool overflow = fp16 && !isfinite(sumsq);
    int applied = step - (int)t->ls.skipped - (overflow ? 1 : 0);
    struct loss_scale ls = t->ls;
    if (fp16) loss_scale_update(&ls, overflow);
    /* Up to here only gradients and activations changed, which the next step rebuilds;
     * from here the parameters and Adam states change, tensor by tensor, until the step
     * count says they belong to this step. */
    uint64_t digest = 0;
    double grad_norm;
    float grad_scale, clip = clip_of(t, sumsq, S, &grad_norm, &grad_scale);
    /* A skipped step's rate is that of the update it would have made. */
    float lr = (float)trainer_lr_at(&t->o.sched, t->o.lr, overflow ? applied + 1 : applied);
    if ((!overflow && (r = optimize(t, applied, lr, grad_scale, &digest)) < 0) ||
        (fp16 && (r = zinf_write(t->e, t->scaler, 0, &ls, sizeof(ls))) < 0) ||
        (r = state_save_step(t, step)) < 0) {
        t->torn = r;
        goto out;
    }
    t->ls = ls;
    t->step_done = step;
    if (t->o.digest && !overflow) {
        /* Every rank's sum over its shards, added: the digest of the whole. */
        if (t->world > 1) TRY(digest_across(t, &digest));
        t->digest = digest;
        t->have_digest = true;
    }
    TRY(zinf_step(t->e));
    double sec = (double)(now_ns() - t0) / 1e9;
    zinf_stats(t->e, &s1);
    *st = (struct trainer_step_stats){
        .step = step,
        .loss = loss,
        .seconds = sec,
        .tokens_per_s = (double)t->o.batch * t->o.seq * total / sec,
        .nvme_read_GBps = (double)(s1.nvme_bytes_read - s0.nvme_bytes_read) / sec / 1e9,
        .nvme_write_GBps = (double)(s1.nvme_bytes_written - s0.nvme_bytes_written) / sec / 1e9,
        .blocked_fraction = (double)(s1.blocked_ns - s0.blocked_ns) / 1e9 / sec,
        .blocked_nvme = (double)(s1.blocked_nvme_ns - s0.blocked_nvme_ns) / 1e9 / sec,
        .blocked_copy = (double)(s1.blocked_copy_ns - s0.blocked_copy_ns) / 1e9 / sec,
        .blocked_room = (double)(s1.blocked_room_ns - s0.blocked_room_ns) / 1e9 / sec,
        .blocked_pin = (double)(s1.blocked_pin_ns - s0.blocked_pin_ns) / 1e9 / sec,
        .device_used = s1.tier[ZINF_TIER_DEVICE].used_bytes,
        .host_used = s1.tier[ZINF_TIER_HOST].used_bytes,
        .skipped = overflow,
        .loss_scale = S,
        .grad_norm = grad_norm,
        .clip_scale = clip,
        .lr = lr,
        .have_digest = t->o.digest && t->have_digest,
        .digest = t->digest,
    };
out:
    trace_span_n("train", "step", step, t0);
    if (r < 0) {
        /* A failed step leaves no half-summed norm behind for the next one. */
        float l;
        double d;
        t->be->ops->collect(t->be, &l, &d);
    }
    return r;
}

/* The tests' crash (ZINF_TEST_KILL_AT=POINT:RANK:N): this rank dies at POINT of its N-th
 * checkpoint (the first is the one at the start). */
static void kill_point(struct trainer *t, const char *point)
{
    if (t->kill_point[0] && t->kill_rank == t->rank && t->kill_nth == t->checkpoint_calls &&
        !strcmp(t->kill_point, point))
        raise(SIGKILL);
}

int trainer_checkpoint(struct trainer *t)
{
    struct zinf_stats s0, s1;
    if (t->torn) return t->torn;
    zinf_stats(t->e, &s0);
    uint64_t t0 = now_ns();
    /* Across ranks a step is saved by all or by none. Each rank meets the others, saves the
     * step keeping its previous version, and meets them again: from then on every rank
     * holds the step, and the previous version goes. A rank that dies anywhere in between
     * fails the others' meeting; each rank then holds the new step, the previous one or
     * both, and a resume goes to the newest that all hold. The manifests carry the step. */
    t->checkpoint_calls++;
    bool two = t->world > 1 && !t->remote;
    kill_point(t, "before-barrier");
    int r = t->world > 1 ? comm_barrier(t->comm) : 0;
    if (r == 0) kill_point(t, "after-barrier");
    if (r == 0) r = scratch_reset(t);
    if (r == 0) r = state_save(t);
    if (r == 0) r = t->remote ? zinf_flush(t->e) : zinf_flush_step(t->e, t->step_done, two ? ZINF_FLUSH_KEEP_PREVIOUS : 0);
    if (r == 0) kill_point(t, "after-rename");
    if (r == 0 && two) r = comm_barrier(t->comm);
    if (r == 0 && two) kill_point(t, "after-commit");
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

void trainer_fault_overflow(struct trainer *t)
{
    t->fault_overflow = true;
}

void trainer_fault_optimizer(struct trainer *t, int tensor, int err)
{
    t->fault_tensor = tensor;
    t->fault_err = err;
}

void trainer_get_summary(struct trainer *t, struct trainer_summary *out)
{
    struct zinf_stats st;
    *out = (struct trainer_summary){.steps_done = t->step_done,
                                    .checkpoints = t->checkpoints,
                                    .checkpoint_step = t->checkpoint_step,
                                    .checkpoint_seconds = t->checkpoint_seconds,
                                    .checkpoint_bytes = t->checkpoint_bytes,
                                    .torn = t->torn != 0};
    note_peaks(t);
    zinf_stats(t->e, &st);
    for (int i = 0; i < t->ntensors; i++)
        out->param_count += t->desc[i].numel;
    out->model_state_bytes = out->param_count * (sizeof(float) * 4 + (t->w != t->p ? 2 : 0));
    out->backend = t->be->name;
    out->precision = t->be->wdt == BACKEND_BF16  ? "bf16"
                     : t->be->wdt == BACKEND_F16 ? "fp16"
                                                 : "fp32";
    out->skipped_steps = t->ls.skipped;
    out->loss_scale = t->be->wdt == BACKEND_F16 ? t->ls.scale : 1;
    out->backend_work_bytes = t->be->work_bytes;
    out->rank = t->rank;
    out->world = t->world;
    out->stage = t->stage;
    out->overlap_comm = t->overlap;
    out->reduce_seconds = (double)t->reduce_ns / 1e9;
    if (t->comm) {
        struct comm_stats cs;
        comm_get_stats(t->comm, &cs);
        out->comm_bytes = cs.bytes_in;
    }
    out->min_budget[0] = t->min_budget[0];
    out->min_budget[1] = t->min_budget[1];
    out->compactions = st.compactions;
    if (!t->remote) { /* the daemon's staging and locking are its own */
        out->staging_bytes = st.host_staging_bytes;
        out->host_pinned = st.host_pinned;
    }
    for (int i = 0; i < 3; i++) {
        out->tier[i].budget_bytes = st.tier[i].capacity_bytes;
        out->tier[i].peak_bytes = t->peak[i];
    }
}

/* ---- validation and sampling ------------------------------------------------------------ */

int trainer_eval(struct trainer *t, int n_batches, float *loss)
{
    int B = t->o.batch, T = t->o.seq, r = 0;
    if (t->torn) return t->torn;
    if (n_batches < 1 || !loss) return -EINVAL;
    if (t->train_bytes == t->data_bytes) return -ENODATA;
    /* Window starts spread evenly over the tail, the last one ending at the data's end. */
    size_t first = t->train_bytes, span = t->data_bytes - t->train_bytes - (size_t)T - 1;
    size_t windows = (size_t)n_batches * (size_t)B;
    double sum = 0;
    for (int j = 0; j < n_batches && r == 0; j++) {
        for (int b = 0; b < B; b++) {
            size_t k = (size_t)j * (size_t)B + (size_t)b;
            size_t off = first + (windows > 1 ? span * k / (windows - 1) : 0);
            for (int i = 0; i < T; i++) {
                t->tokens[b * T + i] = t->data[off + (size_t)i];
                t->targets[b * T + i] = t->data[off + (size_t)i + 1];
            }
        }
        float l = 0;
        double ss;
        if ((r = t->be->ops->set_batch(t->be, t->tokens, t->targets)) == 0 &&
            (r = forward(t)) == 0 && (r = head(t, true, false, false)) == 0 &&
            (r = t->be->ops->collect(t->be, &l, &ss)) == 0)
            sum += l;
    }
    if (r < 0) {
        float l;
        double d;
        t->be->ops->collect(t->be, &l, &d);
        return r;
    }
    *loss = (float)(sum / n_batches);
    return 0;
}

int trainer_sample(struct trainer *t, uint64_t seed, const unsigned char *prompt, size_t plen,
                   unsigned char *out, size_t n)
{
    int B = t->o.batch, T = t->o.seq, C = t->cfg.C, V = t->cfg.V, r = 0;
    float logits[256], mean, rstd;
    size_t done = 0;

    if (t->torn) return t->torn;
    if (!t->o.sample || !prompt || plen < 1 || !out || plen + n > (size_t)T) return -EINVAL;
    unsigned char *ctx = malloc((size_t)T);
    float *x = malloc((size_t)C * sizeof(float)), *xn = malloc((size_t)C * sizeof(float));
    if (!ctx || !x || !xn) {
        free(ctx);
        free(x);
        free(xn);
        return -ENOMEM;
    }
    memcpy(ctx, prompt, plen);
    for (size_t pos = plen - 1; done < n && r == 0; pos++) {
        for (int b = 0; b < B; b++)
            for (int i = 0; i < T; i++) {
                t->tokens[b * T + i] = i <= (int)pos ? ctx[i] : 0;
                t->targets[b * T + i] = 0;
            }
        if ((r = t->be->ops->set_batch(t->be, t->tokens, t->targets)) < 0 || (r = forward(t)) < 0)
            break;
        struct wave w;
        void *p[WAVE_MAX];
        wave_sample(t, &w);
        if ((r = wave_fetch(t, &w, ZINF_TIER_HOST, p)) < 0) break;
        /* Row 0's activation at pos, through the final norm, against each byte's embedding. */
        size_t at = pos * (size_t)C;
        if (t->be->adt == BACKEND_BF16)
            ops_cast_bf16_to_f32(x, (const uint16_t *)p[0] + at, (size_t)C);
        else
            memcpy(x, (const float *)p[0] + at, (size_t)C * sizeof(float));
        ops_layernorm_forward(xn, &mean, &rstd, x, p[1], p[2], 1, (size_t)C);
        const float *wte = p[3];
        float mx = -INFINITY;
        for (int v = 0; v < V; v++) {
            double dot = 0;
            for (int c = 0; c < C; c++)
                dot += (double)wte[(size_t)v * C + c] * xn[c];
            logits[v] = (float)dot;
            mx = MAX(mx, logits[v]);
        }
        wave_release(t, &w, ZINF_TIER_HOST, false);
        double z = 0;
        for (int v = 0; v < V; v++)
            z += exp((double)logits[v] - mx);
        double u = (double)(mix64(seed * 0x9e3779b97f4a7c15ull + pos) >> 11) * 0x1p-53 * z;
        int tok = V - 1;
        for (int v = 0; v < V; v++) {
            u -= exp((double)logits[v] - mx);
            if (u <= 0) {
                tok = v;
                break;
            }
        }
        ctx[pos + 1] = (unsigned char)tok;
        out[done++] = (unsigned char)tok;
        if (pos + 2 >= (size_t)T) break;
    }
    free(ctx);
    free(x);
    free(xn);
    if (r < 0) {
        float l;
        double d;
        t->be->ops->collect(t->be, &l, &d);
        return r;
    }
    return (int)done;
}
