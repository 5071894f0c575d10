/*
 * trainer.h - a GPT-style trainer whose parameters, gradients, Adam states and activation
 * checkpoints all live in a zinf engine: block by block, the forward and backward fetch
 * what they need to the device tier and release it; the optimizer streams each tensor's
 * parameter, gradient, m and v through the host tier. With zinf_step() marks the engine
 * learns the step's order, prefetches ahead and evicts by next use, so the model's state
 * may be many times the device and host budgets.
 *
 * The math runs in a backend (backend.h) chosen by the device tier: the CUDA kernels on a
 * GPU, gpt.c on the CPU over the emulated tier. With bf16 weights (mixed precision, the
 * default on a GPU) the device computes with bf16 copies of the parameters while the fp32
 * masters and Adam states stay with the optimizer, which refreshes both. Not here: the
 * command line (tools/), the math itself.
 */
#ifndef ZINF_TRAIN_TRAINER_H
#define ZINF_TRAIN_TRAINER_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "train/gpt.h"
#include "zinf.h"

struct zinf_config;

enum trainer_precision {
    TRAINER_PRECISION_AUTO, /* bf16 on a GPU, fp32 on the CPU */
    TRAINER_PRECISION_FP32,
    TRAINER_PRECISION_BF16, /* bf16 weights and activations on the device, fp32 masters */
    TRAINER_PRECISION_FP16, /* fp16 weights on the device, fp32 masters, DeepSpeed's loss
                               scaling */
};

/* DeepSpeed's fp16 section: loss_scale 0 is dynamic, from 2^initial_scale_power. */
struct trainer_fp16 {
    double loss_scale, min_loss_scale;
    int initial_scale_power, loss_scale_window, hysteresis;
    bool consecutive_hysteresis;
};

/* The learning rate over the steps: DeepSpeed's schedulers, with their meaning exactly. */
enum trainer_sched { TRAINER_SCHED_CONSTANT, TRAINER_SCHED_WARMUP, TRAINER_SCHED_WARMUP_DECAY,
                     TRAINER_SCHED_WARMUP_COSINE, TRAINER_SCHED_LR_RANGE,
                     TRAINER_SCHED_ONE_CYCLE };

struct trainer_lr_schedule {
    enum trainer_sched type;    /* CONSTANT: lr every step */
    double min_lr, max_lr;      /* WarmupLR, WarmupDecayLR: warmup_min_lr, warmup_max_lr */
    double min_ratio, cos_min_ratio; /* WarmupCosineLR: of lr */
    int warmup_steps;           /* warmup_num_steps (taken as at least 2, as DeepSpeed does) */
    int total_steps;            /* total_num_steps: WarmupDecayLR, WarmupCosineLR */
    bool linear;                /* warmup_type "linear"; else "log" */
    /* LRRangeTest: min_lr (1 + range_rate x (iteration + 1) / range_size), the quotient
     * floored when range_staircase */
    double range_min_lr, range_rate;
    double base_lr;             /* > 0: the optimizer's lr as the config gave it (a double),
                                   which WarmupCosineLR scales; else the lr argument */
    int range_size;
    bool range_staircase;
    /* OneCycle: from cycle_min_lr up to cycle_max_lr over first_size iterations, down over
     * second_size (< 0: first_size), in stairs when the counts are > 0 (second_stairs < 0:
     * first_stairs); then, with decay_step_size > 0, cycle_min_lr / (1 + decay_lr_rate x
     * iterations past the cycle / decay_step_size). With cycle_momentum, beta1 runs the
     * other way between cycle_max_mom and cycle_min_mom (decaying by decay_mom_rate) and
     * beta2 is 0.99, as DeepSpeed's sets them (trainer_betas_at). */
    double cycle_min_lr, cycle_max_lr, decay_lr_rate;
    double cycle_first_size, cycle_second_size;
    int cycle_first_stairs, cycle_second_stairs, decay_step_size;
    bool cycle_momentum;
    double cycle_min_mom, cycle_max_mom, decay_mom_rate;
};

/* Adam as DeepSpeed names its variants: AdamW (decoupled weight decay, the default), Adam
 * with adam_w_mode false (the decay is L2 regularisation in the gradient), and LAMB (Adam's
 * moments, each tensor's step scaled by its trust ratio |w| / |update|, as FusedLamb), and
 * 1-bit Adam (OneBitAdam: freeze_step steps of Adam without bias correction, then the
 * variance frozen and the momentum exchanged compressed to signs, onebit.h). */
enum trainer_optimizer { TRAINER_OPT_ADAMW, TRAINER_OPT_ADAM_L2, TRAINER_OPT_LAMB,
                         TRAINER_OPT_ONEBIT };

/* The learning rate of optimizer step `step` (1-based), as DeepSpeed's scheduler gives it:
 * the scheduler starts at iteration -1 and steps after each optimizer step, so step s
 * runs at iteration s - 2 (the first at the warm-up's start value). */
double trainer_lr_at(const struct trainer_lr_schedule *s, double lr, int step);
/* Adam's betas for step `step`: beta1 and beta2 but under OneCycle with cycle_momentum,
 * where they are what DeepSpeed's OneCycle puts in the optimizer for that step. */
void trainer_betas_at(const struct trainer_lr_schedule *s, double beta1, double beta2, int step,
                      double *b1, double *b2);

#define TRAINER_DEFAULT_JOB "zinf-train"

/* Writes tensor idx of gpt_layout()'s order, all numel floats of it, to dst: 0 or -errno
 * (trainer_opts.init_source). */
typedef int (*trainer_param_source)(void *ctx, int idx, float *dst);

/* Mixture of experts (the config's moe section, --experts, --top-k): every `every`-th
 * block's MLP, from block 0, is E experts (GPT's MLP each) behind a top-k gate (moe.h).
 * Each expert's four tensors are fetched only in a step whose route sends it a token, and
 * the optimizer updates an expert only in a step that gave it a gradient (as torch's
 * optimizers skip a parameter whose .grad is None; Adam's step count is the run's, not the
 * expert's). loss_coef x the sum of the MoE blocks' l_aux is added to the loss. */
struct trainer_moe {
    int E;                  /* experts; 0: none */
    int k;                  /* 1 or 2 */
    int every;              /* 1: every block */
    int ep;                 /* expert-parallel ranks (ep_size); 1 */
    int min_capacity;       /* 4 */
    bool drop_tokens;       /* true */
    float capacity_factor;  /* 1.0 */
    float loss_coef;        /* 0.01 */
    int prefetch;           /* experts asked for ahead, from the gate's choices; 1 */
};

/* LoRA fine-tuning (--lora-rank, the config's zinf.train.lora): rank-r adapters (gpt_lora.h)
 * on the targeted linears of every block, scaled by alpha / r as PEFT's, trained while the
 * model's own weights stay frozen: no gradient, no optimizer state for them. r 0: none. */
struct trainer_lora {
    int r;
    float alpha;      /* 0: r (a scale of 1) */
    unsigned targets; /* 1 << enum gpt_lora_target; c_attn where not given, as PEFT's */
    float dropout;    /* 0 only */
};

struct trainer_opts {
    const char *config_path; /* DeepSpeed-style JSON: budgets, offload devices, nvme paths */
    const char *data_path;   /* any file: its bytes are the tokens */
    struct gpt_config model; /* V must be 256 */
    struct trainer_moe moe;  /* E 0: a dense GPT */
    struct trainer_lora lora; /* r 0: every weight trains */
    int batch, seq;          /* B and T */
    int steps;               /* total steps (a resumed run continues up to this) */
    float lr, weight_decay, grad_clip;
    float beta1, beta2, eps;          /* Adam's: 0.9, 0.999, 1e-8 */
    enum trainer_optimizer optimizer; /* TRAINER_OPT_ADAMW */
    bool no_bias_correction;          /* bias_correction false: Adam's m and v used as they are */
    float lamb_max_coeff, lamb_min_coeff; /* LAMB's trust-ratio bounds: 10, 0.01 */
    bool lamb_eps_inside_sqrt;        /* LAMB: m / sqrt(v + eps) rather than sqrt(v) + eps */
    /* zinf.optimizer_state_dtype: how Adam's m and v are stored (enum adamw_state_dtype:
     * fp32 0, bf16 1 with stochastic rounding, int8 2 blockwise as bitsandbytes' 8-bit
     * Adam), the update itself in fp32 (adamw_states.h; on a GPU where the states are
     * homed on the device, kernels/adamw_states.cu). Not with LAMB; a run resumes only
     * with the dtype it was saved with. */
    int state_dtype;
    int freeze_step;                  /* OneBitAdam: the steps of plain Adam before compression */
    /* communication_data_type: how the gradients' reductions across ranks carry each rank's
     * contribution (enum comm_wire: 0 fp32, 1 fp16, 2 bf16; comm.h says what is rounded). */
    int comm_wire;
    int grad_accum;                   /* micro-batches of `batch` per optimizer step: 1 */
    bool sample;                      /* trainer_sample() will be called: its host-tier set
                                         counts in the budget check */
    struct trainer_lr_schedule sched; /* constant lr by default */
    struct trainer_fp16 fp16;         /* DeepSpeed's defaults: 0, 1, 16, 1000, 2, false */
    uint64_t seed;
    bool resume;             /* continue from the state persisted in the swap directory */
    /* A new run's step 0 is not saved at open (zinf.train.checkpoint_start false): nothing is
     * saved until the first trainer_checkpoint() or a flushed close, and until then the swap
     * files hold the state once (a saved version is never overwritten, so from the first
     * checkpoint on they hold it up to twice). A crash before then leaves no run to resume. */
    bool no_start_checkpoint;
    /* zinf.train.update_in_forward: with one rank (world <= 1) on the CPU, fp32 or bf16, the
     * parameters or the optimizer homed on NVMe and offload_optimizer.pipeline_read on, each
     * step's update is deferred to the next step's forward, which updates each tensor just
     * before its first use (the layout's order), the reads of the tensors after it running
     * while it computes, and sends each weight it wrote to the device at once. The bits are
     * those of the update at the end of the step. Until then trainer_step_stats says
     * update_pending, and the engine holds the step's count beside the previous step's
     * parameters; trainer_checkpoint, trainer_eval, trainer_sample, trainer_finish_update and
     * trainer_close finish it first. A failure in it fails the call (a step is not counted)
     * and leaves the trainer usable: the tensors updated stay so, and the next call goes on
     * with the others, whose gradients nothing touched. Only trainer_close, which cannot try
     * again, leaves the state torn (the last checkpoint stays). Not with MoE blocks (moe.E
     * above 0: their steps update at the end). Off in trainer_opts_defaults;
     * zinf train turns it on unless its config says false (zinf.train.update_in_forward,
     * true by default): on 2 cores with an emulated device, Intel and AMD, its step measured
     * 0.85-0.98x the update at the step's end (bench/RESULTS.md). */
    bool update_in_forward;
    bool overwrite;          /* without resume: delete a saved run there and start over */
    const char *connect;     /* through the zinf daemon on this socket (zinf serve), not an
                                engine of this process; NULL: zinf.connect, else embedded */
    const char *job;         /* the daemon's job; NULL: zinf.job, else TRAINER_DEFAULT_JOB */
    enum trainer_precision precision;
    /* ZeRO across ranks (zinf launch): this process is rank `rank` of `world`, whose
     * communicator meets the others under comm_name. world <= 1: one rank, nothing is
     * partitioned. With world > 1, zero_optimization.stage says what each rank keeps 1/world
     * of: 1 the Adam states, 2 the gradients too, 3 the parameters too (0 counts as 1);
     * each rank's swap files go to a directory of its own, rank-R-of-N under each nvme path
     * (through the daemon, job JOB-rank-R-of-N), and each runs grad_accum micro-batches of
     * its own per step. resume takes the newest saved run under the paths, of any number
     * of ranks, and re-cuts it into this run's shards when that number differs. */
    int rank, world;
    int local_rank; /* LOCAL_RANK (zinf launch): on GPUs, the ordinal of this rank's GPU, which
                       its device tier and NCCL use; -1: zinf.cuda_device */
    bool mpi; /* started by mpirun (OMPI_COMM_WORLD_*): the communicators meet over MPI,
                 across nodes, and comm_name and comm_secret may be NULL (rank 0 makes them) */
    const char *comm_name;
    const char *comm_secret;  /* the job's secret (zinf launch's ZINF_COMM_SECRET), or NULL */
    unsigned comm_timeout_ms; /* how long the ranks wait for each other to meet; 0: 60 s */
    unsigned comm_op_timeout_ms; /* each barrier and collective; 0: zinf.comm_timeout */
    /* A signal handler's flag, or NULL: once set, waiting for the other ranks to meet gives
     * up (trainer_open answers -EINTR). */
    const volatile sig_atomic_t *stop;
    /* Each step's trainer_step_stats.digest: the fp32 parameters hashed as the optimizer
     * writes them (digest.h), about one more pass over them a step. */
    bool digest;
    /* A new run's weights (zinf train --init): each tensor from init_source(init_ctx, ...)
     * instead of GPT-2's initialisation, written to every copy the run keeps (the fp32
     * master, this rank's shard of it at stage 3, the 16-bit weights) before step 0 is
     * saved. NULL: GPT-2's. Not used by a resumed run. When it fails, trainer_open fails
     * with its -errno and nothing of the run is saved. */
    trainer_param_source init_source;
    void *init_ctx;
};

/* The alpha a run's adapters are scaled by (alpha / r): o->lora.alpha, or r where it is 0. */
float trainer_lora_alpha(const struct trainer_opts *o);

struct trainer_step_stats {
    int step;                /* 1-based */
    float loss;
    double seconds;
    double tokens_per_s;
    double nvme_read_GBps, nvme_write_GBps;
    uint64_t nvme_read_bytes, nvme_write_bytes; /* what the step moved from and to NVMe */
    double blocked_fraction; /* of the step's time spent blocked in fetch */
    /* ... of it waiting for: NVMe reads, host<->device copies, room (write-backs), pins
     * (zinf_stats' blocked_*_ns; the rest is the work between waits) */
    double blocked_nvme, blocked_copy, blocked_room, blocked_pin;
    uint64_t device_used, host_used; /* the tiers' bytes in use when the step ended */
    bool skipped;            /* fp16: the gradients overflowed, nothing was updated */
    double loss_scale;       /* fp16: the scale this step's backward ran with; 1 otherwise */
    /* The global norm of the step's gradient (the mean over micro-batches and ranks, the
     * loss scale taken out) before clipping; infinite or NaN where fp16 overflowed. */
    double grad_norm;
    float clip_scale; /* what clipping multiplied that gradient by (1: not clipped) */
    float lr;         /* the learning rate of the update (the schedule's, as a float; on a
                         skipped step, of the update it would have made) */
    /* Across ranks: the bytes this rank sent to the step's collectives (every one: the
     * gradients', the gathers', the losses'), and of them the gradients' reductions (in
     * communication_data_type: 2 bytes an element in fp16 and bf16). 0 on one rank. */
    uint64_t comm_bytes, grad_comm_bytes;
    /* With trainer_opts.digest: the digest (digest.h) of every fp32 parameter after the
     * step, the same on every rank and for any number of ranks; have_digest is false where
     * it is not known (a skipped first step after a resume, or digest off). */
    bool have_digest;
    uint64_t digest;
    /* The step whose parameters `digest` is of: this one, or with an update deferred to the
     * next forward (update_pending), the one before (have_digest false on the first step;
     * the last step's comes from trainer_summary after trainer_finish_update). */
    int digest_step;
    bool update_pending; /* this step's update runs in the next forward (update_in_forward) */
    /* Mixture of experts (0 in a dense run): loss holds the cross-entropy plus moe.loss_coef
     * x moe_aux_loss, the sum of the MoE blocks' balancing losses l_aux (its mean over the
     * step's micro-batches, every rank's); of the `experts`
     * (E x the MoE blocks), experts_used had a token routed to them (summed over the blocks),
     * and expert_bytes_read is what fetching them read from NVMe; of the expert_fetches of
     * their tensors to the device tier, expert_hits found a resident copy (asked for ahead
     * from the gate's choices: trainer_moe.prefetch). */
    float moe_aux_loss;
    int experts, experts_used;
    uint64_t expert_bytes_read, expert_fetches, expert_hits;
};

struct trainer_tier_summary {
    uint64_t budget_bytes, peak_bytes;
};

/* The device and host budgets zinf train uses where the config gives none (zinf.device_bytes,
 * zinf.host_bytes), as a person would choose them: the emulated device a quarter of the RAM
 * available now (MemAvailable), the host half of what is left of it, both split between the
 * ranks of the node, and each at most what the run can hold: the whole of its state (every
 * tensor the trainer registers, counted from the layout) and a quarter more, plus 16 MiB.
 * On a GPU the device tier is the engine's own: the GPU's free memory at open less 1 GiB.
 * 0 where the config gives the budget (or a daemon does); *_how says how each was derived. */
struct trainer_budgets {
    uint64_t device, host;
    uint64_t state_bytes; /* the run's whole state, the bound above */
    char device_how[192], host_how[192];
};
void trainer_derive_budgets(const struct trainer_opts *o, const struct zinf_config *zc, bool cuda,
                            struct trainer_budgets *b);

struct trainer_summary {
    /* Mixture of experts, over the steps this trainer ran: E x the MoE blocks (0: a dense
     * run), the experts that had tokens summed over steps and blocks, and the NVMe bytes
     * that fetching them read. */
    int experts;
    uint64_t experts_used, expert_bytes_read, expert_fetches, expert_hits;
    uint64_t model_state_bytes; /* parameters + gradients + Adam m and v (+ bf16 copies); a
                                   frozen weight's (LoRA) without gradient, m and v */
    /* Of it, Adam's m and v of the whole model as zinf.optimizer_state_dtype stores them
     * (named by optimizer_state_dtype: "fp32", "bf16", "int8"). */
    uint64_t optimizer_state_bytes;
    const char *optimizer_state_dtype;
    struct trainer_budgets budgets; /* how the budgets the config did not give were derived */
    uint64_t param_count;
    uint64_t trainable_count; /* those that train: param_count but with LoRA (the adapters') */
    struct trainer_tier_summary tier[3];
    int steps_done;
    /* Checkpoints (trainer_checkpoint, and trainer_open's of step 0): how many this
     * trainer made, the step the last one saved (what a crash would resume from), its
     * time and the bytes it wrote to the swap files (unchanged tensors are not written). */
    int checkpoints;
    int checkpoint_step;        /* -1: none yet (trainer_opts.no_start_checkpoint) */
    bool torn;                  /* a step failed halfway through the optimizer (trainer_step) */
    double checkpoint_seconds;
    uint64_t checkpoint_bytes;
    const char *backend;        /* "cpu" or "cuda" */
    const char *precision;      /* "fp32" or "bf16": the weights the device computes with */
    uint64_t backend_work_bytes; /* device memory of the backend, outside the budgets */
    /* Of the device tier's bytes, the fixed buffers of exact accumulation and of stage 3's
     * gathers (each as large as one tensor whole, whatever the number of ranks). */
    uint64_t device_scratch_bytes;
    /* The smallest device and host budgets with which every step runs (the homes each
     * tier keeps plus the largest set a step pins there), and how often a set found its
     * tier too fragmented and had it emptied (zinf_stats.compactions). */
    uint64_t min_budget[2];
    uint64_t compactions;
    /* Pinned host memory beside the host budget: the staging ring that NVMe <-> device
     * transfers go through. */
    uint64_t staging_bytes;
    bool host_pinned;           /* the host tier and staging are locked in memory */
    int64_t skipped_steps;      /* fp16: steps skipped for an overflow */
    double loss_scale;          /* fp16: the scale the next step runs with */
    int rank, world, stage;     /* ZeRO: this rank of world; the stage (0 with one rank) */
    uint64_t comm_bytes;        /* bytes this rank sent to collectives */
    uint64_t grad_comm_bytes;   /* of them, to the gradients' reductions (trainer_step_stats) */
    uint64_t comm_ops, comm_pooled_ops; /* its collectives, and of those the ones that read
                                           the peers' buffers in place (zinf.comm_pool) */
    /* Across nodes (zinf launch --hostfile): the bytes this rank sent to and received from
     * ranks on other machines (only the nodes' leaders send any), and of comm_ops those that
     * crossed machines; this rank's node of nodes (0 of 1 on one machine). */
    uint64_t net_bytes_out, net_bytes_in, net_ops;
    int node, nodes;
    /* Pipeline stages (pipeline.stages): this rank's stage of pp (1: none), its blocks
     * [first_block, first_block + blocks); the share of the steps' micro-batch phase this
     * stage spent outside its forwards and backwards (the bubble: waiting for its
     * neighbours), what the 1F1B schedule leaves idle at equal stages, (pp - 1) / (M + pp -
     * 1), and the bytes it sent to the other stages. */
    int pp, pp_stage, first_block, blocks;
    int tp, tp_rank; /* tensor_parallel.autotp_size (1: none), and this rank's of them */
    int sp, sp_rank; /* sequence_parallel_size (1: none), and this rank's of them */
    int seq_local;   /* the positions of each sequence this rank holds */
    double pipeline_bubble, pipeline_bubble_ideal, pipeline_wait_seconds;
    uint64_t pipeline_bytes;
    bool overlap_comm;          /* gradients reduced behind the next block's backward */
    double reduce_seconds;      /* the steps' time waiting for gradient reductions */
    /* The optimizer's pipeline (offload_optimizer.pipeline_read): the sets it asked for
     * while the one before was updated, and of those, the ones the tier had no room for
     * beside it, fetched again alone when their turn came. */
    uint64_t pipeline_ahead, pipeline_refetched;
    /* The updates deferred to the next forward (trainer_opts.update_in_forward), and the
     * digest of the parameters after the last update that computed one, of step digest_step
     * (have_digest false: none yet). */
    bool update_in_forward;
    bool have_digest;
    uint64_t digest;
    int digest_step;
};

struct trainer;

/* What a run of these options would need, decided as trainer_open decides it, with nothing
 * opened: no engine, backend, data, nor meeting of the ranks (o->world and o->rank are
 * taken as given; every rank's shard is the same size). trainer_open refuses a budget under
 * min_budget with the same figures, so a search can leave out what cannot run. */
struct trainer_plan {
    uint64_t min_budget[2];  /* the smallest device and host budgets with which every step runs */
    uint64_t budget[2];      /* the budgets the run opens with: the config's, or derived */
    struct trainer_budgets derived; /* how the budgets the config does not give were derived */
    uint64_t param_count;
    int stage;               /* ZeRO's (0 with one rank) */
    bool cuda;               /* the device tier is a GPU's */
    /* What the tiers would hold, as the engine rounds the budgets (0: not known here, a
     * GPU's free memory at open or a daemon's job); of min_budget, the tensors homed on
     * each tier for good and the set a step pins there at once (NULL: none). */
    uint64_t capacity[2], homes[2];
    const char *what[2];
    /* Where the activation checkpoints are homed (0 device, 1 host, 2 NVMe), and of the
     * host tier's homes, the checkpoints' bytes that an NVMe swap directory would take
     * (zinf.train.activation_offload "auto"; 0: none, or the run has one). */
    int act_tier;
    uint64_t act_host;
};
/* 0, or -errno with one line in err (what trainer_open would say of the options). */
int trainer_plan(const struct trainer_opts *o, struct trainer_plan *p, char *err, size_t errlen);
/* Whether the plan's budgets run every step: 0, or -EINVAL with trainer_open's refusal in err
 * ("zinf.device_bytes: 700 KiB is too small: ..."), in the same words. A tier whose capacity
 * is not known here is taken as large enough. */
int trainer_plan_check(const struct trainer_plan *p, char *err, size_t errlen);

void trainer_opts_defaults(struct trainer_opts *o);
/* What a config's "auto" becomes for these options, as Hugging Face's Trainer fills it
 * from its arguments: the batch, accumulation, steps, lr, weight decay and clipping the run
 * uses, the model's width for the bucket sizes, fp16/bf16 on only where the precision is
 * that type. */
struct config_auto_inputs;
void trainer_auto_inputs(const struct trainer_opts *o, struct config_auto_inputs *in);
/* The options' own consistency (sizes, Adam's hyper-parameters, the schedule, the model's
 * shape), as trainer_open checks them first: -EINVAL with a message in err. */
int trainer_opts_check(const struct trainer_opts *o, char *err, size_t errlen);
/* Opens the engine from the config, registers (or, resuming, finds) every tensor and
 * initialises the parameters; a new run is checkpointed at once (step 0), so that from
 * here a crash at any moment leaves a run to resume. Bad input: -EINVAL (or -ENOENT for a
 * missing file) with one line in err naming what is wrong. A swap directory that holds a
 * saved run is refused with -EEXIST unless resume or overwrite says what to do with it;
 * resume where there is none is -ENOENT ("no saved run in DIR"). */
int trainer_open(const struct trainer_opts *o, struct trainer **out, char *err, size_t errlen);
/* The step that comes next (1-based); trainer_step() runs it. */
int trainer_next_step(const struct trainer *t);
/* Run one step. A step that fails before the optimizer changed anything is not counted
 * and leaves the trainer usable. One that fails while the optimizer updates the state
 * leaves it half updated: from then on trainer_step and trainer_checkpoint return that
 * error, and trainer_close keeps the last checkpoint as the saved state (it does not
 * flush), so that --resume continues exactly from there. */
int trainer_step(struct trainer *t, struct trainer_step_stats *st);
/* Make everything durable (parameters, Adam states, the step count) so that
 * trainer_open(resume) continues exactly here. Only what changed since the last one is
 * written (trainer_get_summary says how much). When it fails, the previous checkpoint
 * stays the saved state, and trainer_close keeps it so unless a later one succeeds. */
int trainer_checkpoint(struct trainer *t);
/* Run what is left of an update deferred to the next forward (trainer_opts.
 * update_in_forward), so that the engine's parameters are the last step's: 0 when none
 * is pending. A failure leaves the tensors updated so and the trainer usable: the next
 * call goes on with the others. */
int trainer_finish_update(struct trainer *t);
void trainer_get_summary(struct trainer *t, struct trainer_summary *out);
/* The mean loss over n_batches batches of the held-out tail (the last tenth of the data,
 * never trained on): windows spread evenly over it, the same every time, so that values
 * compare across steps. Only gradients and activations change (as in a step's first half):
 * a failure leaves the trainer usable. -ENODATA when the data is too short to hold a tail
 * out (less than 10 x (seq + 1) bytes), or a run resumed from before the tail was held. */
int trainer_eval(struct trainer *t, int n_batches, float *loss);
/* Generate up to n bytes after prompt (plen >= 1 bytes, plen + n <= seq), one forward pass
 * per byte, sampling the softmax of the logits at the last position with a generator seeded
 * by seed. Returns the number of bytes written to out. Needs opts.sample for the budget
 * check to count its host-tier set (-EINVAL without it). */
int trainer_sample(struct trainer *t, uint64_t seed, const unsigned char *prompt, size_t plen,
                   unsigned char *out, size_t n);
/* Test-only fault hook, off by default: in the next update, the optimizer's update of the
 * tensor with layout index `tensor` fails with -err (a positive errno) as if fetching it
 * had, after the tensors the optimizer takes before it were updated (it takes them from the
 * last layout index to the first; an update deferred to the next forward, from the first to
 * the last). */
void trainer_fault_optimizer(struct trainer *t, int tensor, int err);
/* Test-only: in the next step that reaches the optimizer, fn(t, arg) is called as its phase
 * begins (to arm an IO fault on what the pipeline has in flight), once. */
void trainer_fault_optimizer_begin(struct trainer *t, void (*fn)(struct trainer *t, unsigned arg),
                                   unsigned arg);
/* Test-only: the next step's write of its count fails with -err (a positive errno), as a
 * zinf_write does: leaving the count as it was. */
void trainer_fault_step_save(struct trainer *t, int err);
/* Test-only, fp16 runs: the next step's gradients count as overflowed. */
void trainer_fault_overflow(struct trainer *t);
/* The trainer's engine, as it is: with an update pending (trainer_step_stats.
 * update_pending), its parameters are the step's before until trainer_finish_update. */
zinf_engine *trainer_engine(struct trainer *t);
/* The engine that holds tensor idx's fp32 parameters ("p." + its name): trainer_engine's, or
 * a LoRA run's base job's (zinf.base_job) for a frozen tensor of the base. */
zinf_engine *trainer_param_engine(struct trainer *t, int idx);
/* Across ranks, whether any rank asks to stop (mine: this one does), so that all stop after
 * the same step; with one rank, mine. A failed exchange (a rank died) says stop. */
bool trainer_any_rank(struct trainer *t, bool mine);
void trainer_close(struct trainer *t);

#endif
