/*
 * trainer_impl.h - what the trainer's files share and nobody else sees: struct trainer (a
 * run), the sets a step pins (enum role, struct wave), the names and formats of what a run
 * saves beside the model's tensors, and the functions one file calls in another, named
 * train_* and listed under the file that defines them.
 *
 *   trainer.c         a run opened and closed, its options, data and batches, summary
 *   trainer_schedule.c the learning-rate and momentum schedules
 *   trainer_sample.c  evaluation on the held-out data, sampling
 *   trainer_tensors.c the tensors a run registers, their homes and sizes, the budgets
 *   trainer_step.c    the sets a step pins (waves), forward, head, backward, trainer_step
 *   trainer_shards.c  ZeRO across ranks: shards, gathers, reductions, the communicator
 *   trainer_optim.c   the optimizer phase: AdamW over every tensor, clipping, digests
 *   trainer_resume.c  the saved state, checkpoints, resume
 *   trainer_recut.c   the re-cut of a run saved in another layout into this one
 *   trainer_layouts.c the saved runs' layouts (stages x tp or sp x ranks), the one a resume
 *                     goes to
 *   trainer_moe.c     mixture of experts: its settings, the layout with MoE blocks
 *   trainer_moe_step.c the MoE blocks' forward and backward, experts fetched when routed
 *
 * Not here: the trainer's interface (trainer.h), or what a file keeps to itself.
 */
#ifndef ZINF_TRAIN_TRAINER_IMPL_H
#define ZINF_TRAIN_TRAINER_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/comm.h"
#include "config.h"
#include "train/gpt.h"
#include "train/backend.h"
#include "train/gpt_tp.h"
#include "train/loss_scale.h"
#include "train/trainer.h"
#include "zinf.h"

struct backend;

#define STATE_NAME "train.state"
#define SCALER_NAME "train.loss_scale"       /* fp16 runs: struct loss_scale */
#define STATE_MAGIC 0x7a696e6674726e33ull    /* "zinftrn3": the tail of the data held out */
#define STATE_MAGIC_V2 0x7a696e6674726e32ull /* "zinftrn2": trained on all of it */
#define HELD_OUT_DIVISOR 10                  /* the last tenth of the data is for validation */
#define ZERO_NAME "train.zero"               /* ranks > 1: struct zero_state */
#define LORA_NAME "train.lora"               /* LoRA: struct lora_state */
#define LORA_MAGIC 0x7a696e666c6f7261ull     /* "zinflora" */
#define ZERO_MAGIC 0x7a696e667a65726full     /* "zinfzero" */
#define SHARD_FLOATS                                                                               \
    1024 /* shards are multiples of 4 KiB (O_DIRECT), and so are the chunks                        \
            the gradient norm is summed by */
#define NLOCAL (GPT_BLOCK_NSLOTS + 4) /* buffers of one block's tensors, then the four others */
#define HOST_COMM_SUFFIX ".host" /* GPU ranks: the host communicator's name is the job's + this */
#define MEM_TIERS (ZINF_TIER_HOST + 1) /* the tiers that hold copies in memory: device, host */

/* What a partitioned run's ranks keep beside the state: a resume must cut alike. */
struct zero_state {
    uint64_t magic;
    int32_t world, stage, rank;
    int32_t persist; /* stage 3: stage3_param_persistence_threshold (0: none) */
};

/* The adapters a LoRA run trains: a resume must train the same. */
struct lora_state {
    uint64_t magic;
    int32_t r;
    uint32_t targets;
    float alpha; /* as given: 0 is r */
    int32_t pad;
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

/* A layout of a run's folders: P pipeline stages x T tensor- or S sequence-parallel ranks
 * (one of T and S is 1) x N ZeRO ranks (the copies), each 1 where unused. Its folders are
 * numbered f = (s I + j) N + q (stage s, tp or sp rank j of I = T S, copy q). */
struct train_lay {
    int32_t P, T, S, N;
};

struct trainer {
    struct trainer_opts o;
    struct gpt_config cfg;
    zinf_engine *e;
    bool remote;      /* e is a client of the daemon on o.connect, attached to o.job */
    /* zinf.base_job: a read-only client of that job of the daemon's, which holds the frozen
     * base (LoRA) that every job naming it reads; NULL: the base is in e */
    zinf_engine *base_e;
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
    /* Where the activation checkpoints are homed (zinf.train.activation_offload, decided by
     * train_act_decide before they are registered), and the setting as given: ACT_*. */
    enum zinf_tier act_tier;
    int act_mode;
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
    bool checkpoint_failed;                               /* the last trainer_checkpoint() failed */
    int fault_tensor, fault_err;                          /* trainer_fault_optimizer() */
    void (*fault_begin)(struct trainer *t, unsigned arg); /* trainer_fault_optimizer_begin() */
    unsigned fault_begin_arg;
    bool fault_overflow; /* trainer_fault_overflow() */
    int fault_save_err;  /* trainer_fault_step_save() */
    double checkpoint_seconds;
    uint64_t checkpoint_bytes;
    uint64_t peak[3];
    uint64_t min_budget[MEM_TIERS]; /* the smallest device and host budgets that run */
    uint64_t persist_below;         /* stage3_param_persistence_threshold when set: the weights
                                       of fewer elements are homed on the device; 0: none */
    bool state_v2;                  /* resumed from a state saved before the held-out tail */

    /* ZeRO across ranks, and exact accumulation. With exact (several ranks, or several
     * micro-batches on the CPU), each micro-batch's gradients are computed afresh into the
     * local buffers lg and then reduced into g: a round of one micro-batch per rank is
     * summed over the ranks in rank order onto what g holds (written by the step's first),
     * so that the step's sum is the chain of its micro-batches in the order of their number
     * whatever the split (train_reduce_req). The clipping norm is then summed by chunks of
     * SHARD_FLOATS in the layout's order, whoever owns them. */
    struct comm *comm;      /* the collectives on buffers of the device tier: NCCL on GPUs */
    struct comm *hcomm;     /* those on host memory: comm itself on the CPU, else shm */
    bool gpu_ranks;         /* comm is NCCL: the device tier is a GPU's */
    uint64_t scratch_bytes; /* the device tier's fixed buffers: lg, lg1, gw, gw1 */
    int rank, world, stage; /* stage: what is 1/world per rank (see trainer_opts) */
    bool exact;
    /* The digest of the parameters after the last step that computed one (trainer_opts.
     * digest): a skipped step changes nothing, so it reports this. */
    bool have_digest;
    uint64_t digest;
    int digest_step; /* the step whose parameters `digest` is of */
    /* The parameters' update (trainer_optim.c): the step's own in its optimizer phase, or
     * deferred to the next forward (defer_ok: trainer_opts.update_in_forward), which
     * runs each tensor's just before its first use. */
    bool defer_ok;
    struct train_update {
        bool pending; /* deferred and not finished */
        bool begun;   /* the fault hook ran */
        int step;     /* the step it belongs to */
        int applied;  /* Adam's count */
        float lr, scale;
        int next;        /* the optimizer's position of the next tensor to update */
        uint64_t digest; /* the digest terms of those updated so far */
    } upd;
    /* The forward's weights that a deferred update wrote, fetched to the device as each is
     * written (fwd_pin: the update runs for the forward's next set) and pinned until they
     * are there (train_update_unpin, before that set is fetched). */
    bool fwd_pin;
    int nfwd_pins;
    struct train_pin {
        zinf_tensor h;
        uint64_t ticket;
    } fwd_pins[GPT_BLOCK_NSLOTS + 2];
    /* The deferred update of the forward's next block runs on a thread of its own while the
     * block before it computes (train_update_start / train_update_join): its reads of the
     * sets wait there, not on the compute. Under umu: a request (ubusy, uupto), its result
     * (ur) and the thread's end (ustop). While ubusy, the thread alone touches the update's
     * state (upd, osets, fwd_pins, the optimizer's counters); the forward reads it only
     * after a join. */
    pthread_t uth;
    bool uth_started, uth_failed, ubusy, ustop; /* uth_failed: it could not be started */
    int uupto, ur;
    pthread_mutex_t umu;
    pthread_cond_t ucv;
    int micro;                         /* the micro-batch being reduced: 0 copies, later ones add */
    int fmicro;                        /* the micro-batch the forward runs (1F1B: not micro) */
    zinf_tensor lg[NLOCAL];            /* this micro-batch's gradients: world x shard floats each */
    zinf_tensor lg1[GPT_BLOCK_NSLOTS]; /* overlap: the odd blocks' (the even ones' are lg) */
    zinf_tensor gw[NLOCAL]; /* stage 3: the gathered weights, world x shard floats each */
    zinf_tensor gw1[GPT_BLOCK_NSLOTS]; /* the odd blocks' (the even ones' are gw) */
    int gw_holds[2];                   /* the block whose weights gw (0) and gw1 (1) hold, or -1 */
    bool budgeting;                    /* min_budgets(): waves as their worst case (every gather) */
    pthread_mutex_t gmu;               /* the next block's gathers in flight: gpending, gerr */
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
        /* On a GPU, the reduction's stream waits for `after` (the compute stream's event
         * past the gradients it reads), and the fold for `done` (the reduction's). */
        void *after, *done;
    } rq[GPT_BLOCK_NSLOTS];
    uint64_t reduce_ns;                /* the time steps waited for gradient reductions */
    uint64_t grad_bytes; /* what this rank contributed to the gradients' reductions (and 1-bit
                            Adam's exchanges), in bytes on the wire: trainer_step_stats */
    uint64_t opt_ahead, opt_refetched; /* trainer_summary.pipeline_ahead, _refetched */
    /* The optimizer's sets by the position it takes them in (trainer_optim.c): those asked
     * for ahead, the first `opt_pre` of them during the backward (their parameters and
     * Adam states, opt_pre_bytes in all, within opt_room). */
    struct opt_set *osets;
    int opt_pre;
    uint64_t opt_pre_bytes, opt_room;
    bool opt_room_known;
    bool last_micro;                /* the step's last micro-batch runs: its backward asks ahead */
    zinf_tensor zstate;             /* struct zero_state */
    float *tmp;                     /* (world + 1) x the largest shard: collectives' other side */
    bool tmp_pooled;                /* tmp is the communicator's (comm_alloc): not freed here */
    float *losses;                  /* world x grad_accum: every micro-batch's loss */
    double *part, *part_all;        /* the norm's chunk sums: this rank's, and every rank's */
    struct trainer_budgets budgets; /* derived where the config gives none */
    struct onebit *onebit; /* 1-bit Adam's state past freeze_step (onebit.c) */
    double *lamb_sums, *lamb_all;   /* LAMB: one tensor's |w|^2 and |u|^2 chunk sums, this
                                       rank's and every rank's (trainer_optim.c) */
    size_t nparts;
    size_t *part_first; /* the first chunk of tensor i */
    /* The nvme paths as given: rank R of N keeps its swap files in rank-R-of-N under each
     * (one rank: in the paths themselves); a pipeline's stage S of P in stage-S-of-P, its
     * copies in rank-R-of-N under that, where base is the stage's folder and root the paths
     * as given (root is NULL where base is those: train_root); a tensor- or sequence-
     * parallel rank's folder is tp-R-of-T (sp-R-of-S), stage-S-of-P.tp-R-of-T with stages.
     * A resume in another layout re-cuts the newest saved run, of layout src (src.N 0: no
     * re-cut) at ZeRO stage src_stage, into this run's tensors and shards. */
    char *base[CONFIG_MAX_NVME_PATHS];
    char *root[CONFIG_MAX_NVME_PATHS];
    unsigned nbase;
    struct train_lay src;
    int src_stage, src_persist;
    /* The step a resume goes to: the newest saved whole by every rank of the run it comes
     * from (-1: unknown, a run saved before checkpoints were tagged with their step). */
    int64_t resume_step;
    /* What each rank of this run's number holds in its own rank-R-of-N folder, gathered from
     * the ranks (train_gather_saved): {zinf_saved_steps' result, its two steps}. Across
     * nodes each node's folders are its ranks' only, so rank 0 cannot read the others'. */
    int64_t (*peer_saved)[3];
    /* Pipeline parallelism (trainer_pipe.c): this rank is stage ps of pp, holding blocks
     * [kb, ke) (pp 1: the whole model, kb 0, ke L). A stage's layout has its own tensors
     * only, in the whole model's order (gidx: the whole layout's index of each), the first
     * stage's wte and wpe, the last's lnf and a copy of wte (wte_copy, its layout index, else
     * -1) that the head computes with, updated from the first stage's gradient. Micro-batches
     * in flight keep their activations in slots: act[slot x (L + 1) + k], act_base the
     * slot's start. */
    int pp, ps, kb, ke, wte_copy, nslots, act_base;
    int *gidx;
    /* Tensor parallel (tensor_parallel.autotp_size): this rank is tr of tp in its stage,
     * holding its slices of every tensor (gpt_tp.h; gdesc: the whole model's tensors, whose
     * slices desc describes), the math's collectives in tpc. mp: pp or tp above 1. */
    int tp, tr;
    /* Sequence parallel (sequence_parallel_size, Ulysses): rank sq of sp holds T / sp
     * positions of every sequence (gpt_sp.h); its gradients are summed over the group
     * before anything else reduces them. Not with tp. */
    int sp, sq;
    struct backend_sp spc;
    bool mp;
    struct gpt_tp_comm tpc;
    struct gpt_tensor_desc *gdesc;
    struct pipe *pipe;
    /* Mixture of experts (trainer_moe_step.c): the MoE blocks' working state; NULL in a
     * dense run. */
    struct train_moe *moe;
    /* Expert parallel (moe.ep_size, the ZeRO ranks): this rank's layout holds only its E/ep
     * experts of each MoE block (gidx: their number in the whole model's), whole. priv[i]:
     * tensor i is such an expert, which no other rank has: ZeRO neither partitions nor
     * reduces it (train_private). NULL without expert parallelism. */
    int ep;
    bool *priv;
    /* LoRA (trainer_lora.c): the layout's first adapter; those before it are frozen. */
    int lora_first;
    /* ZINF_TEST_KILL_AT=POINT:RANK:N: the tests' crash, at POINT of the N-th checkpoint. */
    char kill_point[32];
    int kill_rank, kill_nth, checkpoint_calls;
};

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
    int idx[WAVE_MAX];     /* layout index (an activation's number for R_ACT) */
    bool dirty[WAVE_MAX];  /* released dirty when the phase succeeded */
    bool spent[WAVE_MAX];  /* released as zeros (ZINF_RELEASE_ZERO) when it succeeded: a
                              gradient its update consumed, which the next backward
                              overwrites, so that nothing reads or writes it meanwhile */
    int8_t from[WAVE_MAX]; /* the member gathered into this one (stage 3), else -1 */
    bool async[WAVE_MAX];  /* that gather is the next block's: it runs while this one computes */
    int ahead;             /* 1 + the block gathered ahead (async); 0: none */
    bool reduce[WAVE_MAX]; /* a local gradient reduced into the next member (its g) while
                              this set computes (overlap_comm) */
    int behind;            /* 1 + the block whose gradients those are; 0: none */
    int ne;
    int8_t at[WAVE_MAX]; /* entry -> member */
};

/* trainer.c: a run's setup (the tier of an offload device, a step's batch, the peaks) */
enum zinf_tier train_home_of(enum config_offload_device d);
void train_load_batch(struct trainer *t, int s, int m);
void train_note_peaks(struct trainer *t);
uint64_t train_mix64(uint64_t z);

/* trainer_tensors.c: the tensors' sizes, their registration, the budgets */
size_t train_role_bytes(const struct trainer *t, enum role role, int idx);
/* What fetching w's members of the roles in the mask (bit 1 << role) to tier allocates
 * there: those not homed in it, each rounded up to 4 KiB. */
uint64_t train_wave_need(const struct trainer *t, const struct wave *w, enum zinf_tier tier,
                         unsigned roles);
void train_min_budgets(struct trainer *t, uint64_t need[MEM_TIERS], uint64_t homes[MEM_TIERS],
                       const char *what[MEM_TIERS]);
/* train_min_budgets with the activation checkpoints where "auto" puts them at the least
 * budgets (trainer_tensors.c): the figures a refusal and the summary's min_budget name. */
void train_least_budgets(struct trainer *t, uint64_t need[MEM_TIERS], uint64_t homes[MEM_TIERS],
                         const char *what[MEM_TIERS]);
int train_budget_refusal(const uint64_t cap[MEM_TIERS], const uint64_t need[MEM_TIERS],
                         const uint64_t homes[MEM_TIERS], const char *const what[MEM_TIERS],
                         uint64_t act_host, char *err, size_t errlen);
int train_check_budgets(struct trainer *t, char *err, size_t errlen);
/* zinf.train.activation_offload's values (and cpu_checkpointing's: true ACT_AUTO, false
 * ACT_DEVICE). */
enum { ACT_AUTO, ACT_DEVICE, ACT_HOST, ACT_NVME };
/* The run's setting of where the checkpoints go, checked: -EINVAL with err naming the keys
 * where cpu_checkpointing and activation_offload disagree or "nvme" has no swap directory. */
int train_act_mode(struct trainer *t, char *err, size_t errlen);
/* Where the checkpoints are homed, for tiers of capacity cap (0: not known): "auto" homes
 * them on NVMe where the host tier cannot hold them beside the rest and the run has a swap
 * directory of its own, else in the host tier. */
void train_act_decide(struct trainer *t, const uint64_t cap[MEM_TIERS]);
/* Bytes of checkpoints homed in the host tier that "auto" would move to NVMe given a swap
 * directory (0: none, or the run has one): what a refusal names as the way out. */
uint64_t train_act_host_bytes(const struct trainer *t);
int train_scratch_reset(struct trainer *t);
uint64_t train_scratch_bytes(struct trainer *t);
int train_register_all(struct trainer *t, char *err, size_t errlen);
int train_init_params(struct trainer *t);
int train_write_params(struct trainer *t, trainer_param_source get, void *ctx);
int train_write_w(struct trainer *t, int i, const float *p, uint16_t *b16, size_t n);

/* trainer_step.c: the sets a step pins, and the phases that fetch them */
int train_gw_set(const struct trainer *t, int k);
bool train_gathered(const struct trainer *t, int k);
int train_lg_set(const struct trainer *t, int k);
void train_wave_embed_forward(struct trainer *t, struct wave *w);
void train_wave_block_forward(struct trainer *t, int k, struct wave *w);
void train_wave_head(struct trainer *t, struct wave *w);
void train_wave_block_backward(struct trainer *t, int k, struct wave *w);
void train_wave_embed_backward(struct trainer *t, struct wave *w);
void train_wave_optimizer(struct trainer *t, int i, struct wave *w);
void train_wave_sample(struct trainer *t, struct wave *w);
zinf_tensor train_wave_handle(const struct trainer *t, enum role role, int idx);
int train_wave_fetch(struct trainer *t, const struct wave *w, enum zinf_tier tier, void **ptrs);
int train_wave_release(struct trainer *t, const struct wave *w, enum zinf_tier tier, bool ok);
int train_settle(struct trainer *t, int r);
int train_forward(struct trainer *t);
int train_head(struct trainer *t, bool zero, bool norm, bool reduce);
int train_backward(struct trainer *t, bool zero, bool norm);

/* trainer_shards.c: shards, gathers, reductions, the ranks' agreements */
void train_gather_done(struct comm_req *req, int res);
void train_reduce_done(struct comm_req *req, int res);
int train_submit_async(struct trainer *t, struct comm_req *q);
int train_fold_behind(struct trainer *t, int n);
size_t train_shard_of(const struct trainer *t, int idx);
size_t train_shard_lo(const struct trainer *t, int idx);
size_t train_shard_own(const struct trainer *t, int idx);
int train_stage_of(const struct trainer *t, int idx);
bool train_private(const struct trainer *t, int idx);
/* The ranks' shape from the options and config (world, rank, stage, exact, overlap); say:
 * notice what the config asks that cannot be. train_zero_setup takes it and meets the ranks. */
int train_zero_shape(struct trainer *t, bool say, char *err, size_t errlen);
size_t train_tmp_bytes(const struct trainer *t);
int train_zero_setup(struct trainer *t, bool cuda, char *err, size_t errlen);
int train_zero_alloc(struct trainer *t);
int train_ranks_agree(struct trainer *t, char *err, size_t errlen);
void train_reduce_req(struct trainer *t, int i, float *l, float *g, struct comm_req *q);
int train_reduce_grad(struct trainer *t, int i, float *l, float *g);
int train_grad_norm(struct trainer *t, double *sumsq);
int train_digest_across(struct trainer *t, uint64_t *d);

/* trainer_optim.c: the optimizer phase */
float train_clip_of(const struct trainer *t, double sumsq, double loss_scale, double *norm,
                    float *grad_scale);
int train_optimize(struct trainer *t, int step, float lr, float scale, uint64_t *digest);
/* The update deferred to the next forward: recorded (the step's, Adam's count `applied`),
 * then run up to the layout index before `upto` (pin: each tensor's weights fetched to the
 * device after its update, pinned until train_update_unpin waits for them and lets go),
 * then to the end (0 when none is pending).
 * On a failure (-errno) the tensors done stay done and the next call goes on from there. */
void train_update_defer(struct trainer *t, int step, int applied, float lr, float scale);
int train_update_until(struct trainer *t, int upto, bool pin);
void train_update_unpin(struct trainer *t);
int train_update_finish(struct trainer *t);
/* train_update_until(t, upto, true) on the update's thread, returning at once (nothing
 * when that thread cannot be started: the forward's own call runs it); train_update_join
 * waits for it and returns its result (0 when none ran). train_update_stop ends the thread
 * (trainer_close). */
void train_update_start(struct trainer *t, int upto);
int train_update_join(struct trainer *t);
void train_update_stop(struct trainer *t);
/* During the backward, `done` of `of` blocks through: ask for the parameters and Adam
 * states of the optimizer's first sets, up to that share of the host tier's spare room. */
void train_optimizer_ahead(struct trainer *t, int done, int of);
/* Drop the sets asked for ahead (a step that fails or skips its update). */
void train_optimizer_drop(struct trainer *t);

/* trainer_moe.c: mixture of experts. train_moe_opts_check (in trainer_opts_check) checks
 * the settings; train_moe_layout writes the layout of the model with its MoE blocks (as
 * gpt_layout: the count, the descriptions to out when out is not NULL), or -errno with err
 * naming what the run cannot do with MoE; train_moe_block: whether block k is one. */
int train_moe_opts_check(const struct trainer_opts *o, char *err, size_t errlen);
int train_moe_layout(struct trainer *t, struct gpt_tensor_desc *out, size_t cap, char *err,
                     size_t errlen);
bool train_moe_block(const struct trainer *t, int k);
/* Whether this rank holds tensor d of the whole model's layout (expert parallel: an expert
 * of another rank is not), and whether d is an expert's. */
bool train_moe_mine(const struct trainer *t, const struct gpt_tensor_desc *d);
bool train_moe_expert(const struct trainer *t, const struct gpt_tensor_desc *d);
/* The rank that holds tensor d whole in a run of `ranks` expert-parallel ranks: its
 * expert's owner; 0 for every other tensor (which ZeRO cuts or rank 0 holds whole). */
int train_moe_owner(const struct trainer *t, const struct gpt_tensor_desc *d, int ranks);

/* trainer_lora.c: LoRA. train_lora_opts_check (in trainer_opts_check) checks the settings;
 * train_lora_count is how many adapter tensors the layout appends, train_lora_layout writes
 * them after the model's (t->ntensors counting them) or refuses what the run cannot do with
 * them (-EINVAL, err naming it); train_frozen: tensor i gets no gradient and no optimizer
 * state; train_idle: the optimizer leaves tensor i alone this step (frozen, or an idle
 * expert's); train_lora_index: the tensor of block k's adapter of target j, A (ab 0) or B
 * (ab 1), -1 where none; train_lora_adapter: tensor i is an adapter; train_lora_init: a new
 * run's values of adapter i; train_lora_scale: alpha / r. */
int train_lora_opts_check(const struct trainer_opts *o, char *err, size_t errlen);
/* trainer_base.c: zinf.base_job. train_base_open connects t->base read-only to the base job
 * (0 without one; refused, naming the key, where the run cannot have one), train_base_close
 * ends it; train_engine_of: the engine a role's handle of tensor idx is in; train_base_lookup:
 * the base's tensor prefix + tensor i's name, checked to hold bytes; train_fetch_set:
 * zinf_fetch_all of set w's handles hs, the base's part from the base. */
int train_base_open(struct trainer *t, char *err, size_t errlen);
void train_base_close(struct trainer *t);
zinf_engine *train_engine_of(const struct trainer *t, int role, int idx);
int train_base_lookup(struct trainer *t, const char *prefix, int i, size_t bytes,
                      zinf_tensor *out, char *err, size_t errlen);
struct wave;
int train_fetch_set(struct trainer *t, const struct wave *w, const zinf_tensor *hs,
                    enum zinf_tier tier, void **m);
int train_lora_count(const struct trainer *t);
int train_lora_layout(struct trainer *t, char *err, size_t errlen);
bool train_frozen(const struct trainer *t, int i);
bool train_idle(const struct trainer *t, int i);
int train_lora_index(const struct trainer *t, int k, int j, int ab);
bool train_lora_adapter(const struct trainer *t, int i);
int train_lora_init(const struct trainer *t, int i, float *dst);
/* The run's adapters saved beside the state (LORA_NAME; a new LoRA run's), or on a resume
 * checked against the saved run's: -EINVAL with err saying what to give. */
int train_lora_state(struct trainer *t, char *err, size_t errlen);
float train_lora_scale(const struct trainer *t);

/* trainer_moe_step.c: the MoE blocks' phases. A MoE block keeps the 12 tensors of a dense
 * one at block_first[k] (so every block's are where the dense code looks), but its four MLP
 * tensors are never fetched nor updated: its gate and experts, appended after the dense
 * layout, stand in. train_moe_setup makes the working state once the layout is known;
 * train_moe_forward and train_moe_backward run block k; train_moe_idle says whether the
 * optimizer leaves tensor i alone this step (a MoE block's dense MLP, or an expert that no
 * token was routed to: it has no gradient); train_moe_step_begin and _end bracket a step
 * (the loss's aux term, the step's counts in st). */
int train_moe_setup(struct trainer *t, char *err, size_t errlen);
void train_moe_free(struct trainer *t);
int train_moe_forward(struct trainer *t, int k);
int train_moe_backward(struct trainer *t, int k, bool zero, bool norm);
bool train_moe_idle(const struct trainer *t, int i);
void train_moe_step_begin(struct trainer *t);
float train_moe_aux(struct trainer *t);
void train_moe_step_end(struct trainer *t, struct trainer_step_stats *st);
void train_moe_summary(struct trainer *t, struct trainer_summary *out);
/* The sets MoE block k's phases fetch, for the budgets: the n-th into w, false past the
 * last (one expert's stands for all of them: they are alike). */
bool train_moe_wave(struct trainer *t, int k, int n, struct wave *w);
/* Pipeline stages: the l_aux of each MoE block of this stage in each micro-batch's forward,
 * (M, L) floats, 0 for the others' blocks (NULL without MoE); the step's micro-batch m's sum
 * over every stage's blocks (aux, (M) floats, in block order) becomes the one the step
 * reports (train_moe_pipe_aux). */
float *train_moe_aux_blocks(struct trainer *t);
void train_moe_pipe_aux(struct trainer *t, const float *aux, int M);
/* trainer_pipe.c: v (n values) summed over the stages, on every stage. */
int train_pipe_sum_u64(struct trainer *t, uint64_t *v, int n);

/* trainer_pipe.c: pipeline stages, tensor- and sequence-parallel ranks. train_pipe_shape
 * reads the layout of the ranks from the config (in train_zero_shape: the stage, its blocks,
 * the rank within the stage; world and rank become the copies of the model, ZeRO's);
 * train_pipe_setup meets the other ranks of the copy (each in a folder of its own under the
 * nvme paths); train_pipe_layout keeps the rank's tensors (slices with tp); train_pipe_alloc
 * the buffers once the layout is known. train_pipe_step runs the step's micro-batches on the
 * 1F1B schedule, leaving each one's loss in t->losses (every stage's the same) and the
 * gradients summed as one rank's; train_pipe_norm, _digest and _any are the stages'
 * agreements. */
int train_pipe_shape(struct trainer *t, char *err, size_t errlen);
int train_pipe_setup(struct trainer *t, bool cuda, char *err, size_t errlen);
int train_pipe_layout(struct trainer *t);
int train_pipe_alloc(struct trainer *t);
int train_pipe_step(struct trainer *t, int step, double *loss_sum);
int train_pipe_norm(struct trainer *t, double *sumsq);
int train_pipe_digest(struct trainer *t, uint64_t *d);
bool train_pipe_any(struct trainer *t, bool mine);
int train_pipe_wte_in(struct trainer *t);
int train_pipe_wte_out(struct trainer *t);
void train_pipe_close(struct trainer *t);
/* Whether layout index i is a slice of its tensor (tensor parallel), not the whole. */
bool train_tp_sliced(const struct trainer *t, int i);
/* Sequence parallel: n floats at l summed over the group in place, the same on every rank
 * of it; 0 without. train_sp_sum: host memory (a loss); train_sp_grad_sum: a local gradient
 * in the backend's memory (device memory on GPU ranks, over their NCCL link), the work that
 * wrote it done. */
int train_sp_sum(struct trainer *t, float *l, size_t n);
int train_sp_grad_sum(struct trainer *t, float *l, size_t n);
/* A barrier over every rank of the run (trainer_checkpoint's meetings). */
int train_barrier_all(struct trainer *t);
/* bytes of buf from stage 0 to every stage of this copy of the pipeline (all call it). */
int train_pipe_bcast(struct trainer *t, void *buf, size_t bytes);
/* bytes of buf from tp (sp) rank 0 to every tp (sp) rank of this stage (all call it). */
int train_group_bcast(struct trainer *t, void *buf, size_t bytes);
void train_pipe_summary(struct trainer *t, struct trainer_summary *out);

/* trainer_resume.c: the saved state, checkpoints, the crashes */
int train_state_check(struct trainer *t, char *err, size_t errlen);
/* The saved state s, of a run of src_world copies, against this run: 0, or -EINVAL and why. */
int train_state_validate(struct trainer *t, struct train_state s, int src_world, char *err,
                         size_t errlen);
int train_state_save_step(struct trainer *t, int step_done);
char *train_rank_dir(const char *base, int world, int rank);
int train_version_flag(const char *dir, int64_t step, unsigned *flag);
void train_kill_point(struct trainer *t, const char *point);

/* trainer_recut.c: a run saved in another layout re-cut into this one's tensors */
int train_recut_check(struct trainer *t, char *err, size_t errlen);
int train_recut(struct trainer *t, char *err, size_t errlen);

/* trainer_layouts.c: the saved runs of every layout (struct train_lay), in
 * [stage-S-of-P][.|/][tp-J-of-T|sp-J-of-S][/rank-R-of-N] under each nvme path. */
struct train_saved {
    struct train_lay lay; /* the run a resume goes to (lay.P 0: none) */
    struct train_lay bad; /* a run passed over (P 0: none): this run's layout where it is one */
    int32_t bad_f;        /* its first folder (train_lay's f) that holds no saved run; -1:
                             each holds one, but no step is held by all */
    int32_t pad;
    int64_t step;   /* the step every folder of lay holds (-1: untagged, before steps were) */
    int64_t newest; /* the newest step any of them holds */
};
const char *train_root(const struct trainer *t, unsigned k);
/* This run's layout: stages, tp, sp, copies. */
struct train_lay train_own_layout(const struct trainer *t);
bool train_lay_same(const struct train_lay *a, const struct train_lay *b);
/* Folder f of layout l under root (malloc'd; NULL: no memory). */
char *train_layout_dir(const char *root, const struct train_lay *l, int f);
/* "one rank", "4 ranks", "3 pipeline stages x 2 ranks", "2 tensor-parallel ranks x 2 copies" */
const char *train_layout_name(const struct train_lay *l, char *buf, size_t len);
/* "rank R", "stage S", "stage S rank R", "stage S tp rank J copy R": folder f of l. */
const char *train_folder_name(const struct train_lay *l, int f, char *buf, size_t len);
int train_newest_run(const struct trainer *t, struct train_saved *out);
/* Every rank's saved steps into t->peer_saved, over the host communicator (world > 1). */
int train_gather_saved(struct trainer *t);
int train_remove_other_runs(struct trainer *t, char *err, size_t errlen);
/* trainer_open's look at the swap path: the saved run found, agreed by every rank, and
 * what it means for this run (a resume, a re-cut: src, checked; a refusal;
 * the other layouts removed for --overwrite). */
int train_find_saved(struct trainer *t, char *err, size_t errlen);

#endif
