/*
 * config.c - reads a DeepSpeed-style JSON config (jansson) into struct zinf_config.
 *
 * One table, fields[], says for every setting where it lives, its type, its range and
 * where it is stored; parsing, "given" bookkeeping and config_print all walk that table,
 * so a setting added there is read, checked and printed at once. Sections are walked key
 * by key: a key is a setting, a subsection, a DeepSpeed key zinf does not use (accepted
 * without looking at its value) or unknown (collected and warned about). The first bad
 * value stops the parse with one line, "json.path: what is wrong".
 *
 * What it is not: a DeepSpeed validator for the keys zinf ignores, nor an hjson reader
 * (DeepSpeed reads hjson; comments in a config are a syntax error here).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "common.h"
#include "config.h"

#define MAX_FILE_BYTES (64 * MiB) /* a config larger than this is a mistake, not a config */
#define MAX_PATH_BYTES 4095       /* longest directory name accepted (PATH_MAX less NUL) */
#define KEY_SHOWN_BYTES 128       /* longer keys are cut in messages */
#define JSON_PATH_CHARS 512       /* room for section.path + one shown key + "[index]" */

enum sect { S_TOP, S_ZERO, S_PARAM, S_OPTIM, S_AIO, S_ZINF, S_TRAIN, S_SERVE, S_OPT, S_OPT_PARAMS,
            S_SCHED, S_SCHED_PARAMS, S_FP16, S_BF16, S_COUNT };

/* DeepSpeed keys zinf has no use for, each with why. Their values are not looked at: they
 * are DeepSpeed's business, and a config DeepSpeed accepts must be accepted here. */
struct ignored_key {
    const char *key, *why;
};
static const struct ignored_key top_ignored[] = {
    {"amp", "mixed precision is fp16, bf16 or zinf.train.precision"},
    {"torch_autocast", "mixed precision is fp16, bf16 or zinf.train.precision"},
    {"prescale_gradients", "zinf sums gradients across ranks exactly, then divides once"},
    {"gradient_predivide_factor", "zinf sums gradients across ranks exactly, then divides once"},
    {"sparse_gradients", "zinf's gradients are dense"},
    {"wall_clock_breakdown", "profiling: zinf train's step lines, --log and --trace give the times"},
    {"memory_breakdown", "profiling: zinf train's step lines, --log and --trace give the times"},
    {"flops_profiler", "profiling: zinf train's step lines, --log and --trace give the times"},
    {"timers", "profiling: zinf train's step lines, --log and --trace give the times"},
    {"comms_logger", "profiling: zinf train's step lines, --log and --trace give the times"},
    {"dump_state", "DeepSpeed's own debug output"},
    {"zero_allow_untested_optimizer", "zinf's optimizer is its own AdamW kernel"},
    {"zero_force_ds_cpu_optimizer", "zinf's optimizer is its own AdamW kernel"},
    {"activation_checkpointing", "zinf train recomputes each block's activations in the backward already"},
    {"tensorboard", "monitoring: zinf train --log writes every step as a JSON line"},
    {"wandb", "monitoring: zinf train --log writes every step as a JSON line"},
    {"csv_monitor", "monitoring: zinf train --log writes every step as a JSON line"},
    {"comet", "monitoring: zinf train --log writes every step as a JSON line"},
    {"autotuning", "zinf tune measures the IO settings instead"},
    {"elasticity", "the ranks are fixed by zinf launch -n"},
    {"communication_data_type", "collectives move each tensor in its own type"},
    {"seq_parallel_communication_data_type", "a DeepSpeed feature zinf does not have"},
    {"data_types", "each tensor keeps its own type"},
    {"disable_allgather", "zinf's collectives size their own buffers"},
    {"sparse_attention", "a DeepSpeed feature zinf does not have"},
    {"pipeline", "a DeepSpeed feature zinf does not have"},
    {"progressive_layer_drop", "a DeepSpeed feature zinf does not have"},
    {"curriculum_learning", "a DeepSpeed feature zinf does not have"},
    {"data_efficiency", "a DeepSpeed feature zinf does not have"},
    {"compression_training", "a DeepSpeed feature zinf does not have"},
    {"checkpoint", "zinf checkpoints the swap directory itself (zinf.train.checkpoint_every)"},
    {"eigenvalue", "a DeepSpeed feature zinf does not have"},
    {"quantize_training", "a DeepSpeed feature zinf does not have"},
    {"nebula", "zinf checkpoints the swap directory itself (zinf.train.checkpoint_every)"},
    {"hybrid_engine", "a DeepSpeed feature zinf does not have"},
    {"weight_quantization", "a DeepSpeed feature zinf does not have"},
    {"compile", "a DeepSpeed feature zinf does not have"},
    {"graph_harvesting", "a DeepSpeed feature zinf does not have"},
    {"dataloader_drop_last", "zinf train draws its own batches"},
    {"use_data_before_expert_parallelism", "a DeepSpeed feature zinf does not have"},
    {"tensor_parallel", "a DeepSpeed feature zinf does not have"},
    {NULL, NULL}};
static const struct ignored_key zero_ignored[] = {
    {"contiguous_gradients", "zinf's gradients are contiguous in their own buffers always"},
    {"reduce_scatter", "zinf's collectives size their own buffers"},
    {"use_multi_rank_bucket_allreduce", "zinf's collectives size their own buffers"},
    {"allgather_partitions", "zinf's collectives size their own buffers"},
    {"allgather_bucket_size", "zinf's collectives size their own buffers"},
    {"allgather_size", "zinf's collectives size their own buffers"},
    {"load_from_fp32_weights", "zinf resumes from its own fp32 state"},
    {"elastic_checkpoint", "zinf re-cuts a saved run for another number of ranks itself"},
    {"round_robin_gradients", "zinf's collectives size their own buffers"},
    {"stage3_gather_16bit_weights_on_model_save", "zinf train --export writes the whole fp32 weights"},
    {"gather_16bit_weights_on_model_save", "zinf train --export writes the whole fp32 weights"},
    {"stage3_gather_fp16_weights_on_model_save", "zinf train --export writes the whole fp32 weights"},
    {"stage3_model_persistence_threshold", "zinf keeps small tensors resident by stage3_param_persistence_threshold"},
    {"model_persistence_threshold", "zinf keeps small tensors resident by stage3_param_persistence_threshold"},
    {"stage3_module_granularity_threshold", "zinf fetches tensors, not modules"},
    {"module_granularity_threshold", "zinf fetches tensors, not modules"},
    {"stage3_use_all_reduce_for_fetch_params", "zinf's collectives size their own buffers"},
    {"use_all_reduce_for_fetch_params", "zinf's collectives size their own buffers"},
    {"ignore_unused_parameters", "every parameter of zinf's model is used"},
    {"legacy_stage1", "a DeepSpeed feature zinf does not have"},
    {"memory_efficient_linear", "zinf's linear layers save no extra copies"},
    {"zero_hpz_partition_size", "a DeepSpeed feature zinf does not have"},
    {"zero_quantized_weights", "a DeepSpeed feature zinf does not have"},
    {"zero_quantized_nontrainable_weights", "a DeepSpeed feature zinf does not have"},
    {"zero_quantized_gradients", "a DeepSpeed feature zinf does not have"},
    {"zeropp_loco_param", "a DeepSpeed feature zinf does not have"},
    {"mics_shard_size", "a DeepSpeed feature zinf does not have"},
    {"mics_hierarchical_params_gather", "a DeepSpeed feature zinf does not have"},
    {"pipeline_loading_checkpoint", "a DeepSpeed feature zinf does not have"},
    {"override_module_apply", "a DeepSpeed feature zinf does not have"},
    {"log_trace_cache_warnings", "zinf learns the step's order without a trace cache"},
    {NULL, NULL}};
static const struct ignored_key offload_ignored[] = {
    {"ratio", "zinf offloads whole tensors"},
    {"pipeline", "zinf overlaps the NVMe traffic with compute always"},
    {NULL, NULL}};
static const struct ignored_key opt_ignored[] = {
    {"legacy_fusion", "zinf's optimizer is its own AdamW kernel"},
    {NULL, NULL}};
static const struct ignored_key opt_params_ignored[] = {
    {"torch_adam", "zinf's optimizer is its own AdamW kernel"},
    {"amsgrad", "zinf's Adam has no AMSGrad variant"},
    {"fused", "zinf's optimizer is its own AdamW kernel"},
    {"freeze_step", "1-bit Adam's; zinf's Adam is not compressed"},
    {"cuda_aware", "1-bit Adam's; zinf's Adam is not compressed"},
    {"comm_backend_name", "1-bit Adam's; zinf's Adam is not compressed"},
    {"max_grad_norm", "Lamb's own clipping: zinf clips by gradient_clipping"},
    {"momentum", "SGD's; zinf train runs Adam"},
    {"nesterov", "SGD's; zinf train runs Adam"},
    {"dampening", "SGD's; zinf train runs Adam"},
    {"lr_decay", "Adagrad's; zinf train runs Adam"},
    {"initial_accumulator_value", "Adagrad's; zinf train runs Adam"},
    {NULL, NULL}};
static const struct ignored_key sched_params_ignored[] = {
    {"last_batch_iteration", "a resumed run continues the schedule at its saved step"},
    {NULL, NULL}};
static const struct ignored_key fp16_ignored[] = {
    {"auto_cast", "zinf casts at each layer itself"},
    {"fp16_master_weights_and_grads", "zinf keeps fp32 master weights always"},
    {NULL, NULL}};
static const struct ignored_key bf16_ignored[] = {
    {"immediate_grad_update", "zinf applies the gradients at the step"},
    {"check_grad_overflow", "bf16 does not overflow as fp16 does: zinf checks fp16 only"},
    {"check_overflow", "bf16 does not overflow as fp16 does: zinf checks fp16 only"},
    {NULL, NULL}};

static const struct sectdef {
    const char *key;  /* name inside the parent section */
    const char *path; /* full JSON path */
    int parent;
    const struct ignored_key *ignored;
} sects[S_COUNT] = {
    [S_TOP] = {NULL, NULL, -1, top_ignored},
    [S_ZERO] = {"zero_optimization", "zero_optimization", S_TOP, zero_ignored},
    [S_PARAM] = {"offload_param", "zero_optimization.offload_param", S_ZERO, offload_ignored},
    [S_OPTIM] = {"offload_optimizer", "zero_optimization.offload_optimizer", S_ZERO,
                 offload_ignored},
    [S_AIO] = {"aio", "aio", S_TOP, NULL},
    [S_ZINF] = {"zinf", "zinf", S_TOP, NULL},
    [S_TRAIN] = {"train", "zinf.train", S_ZINF, NULL},
    [S_SERVE] = {"serve", "zinf.serve", S_ZINF, NULL},
    [S_OPT] = {"optimizer", "optimizer", S_TOP, opt_ignored},
    [S_OPT_PARAMS] = {"params", "optimizer.params", S_OPT, opt_params_ignored},
    [S_SCHED] = {"scheduler", "scheduler", S_TOP, NULL},
    [S_SCHED_PARAMS] = {"params", "scheduler.params", S_SCHED, sched_params_ignored},
    [S_FP16] = {"fp16", "fp16", S_TOP, fp16_ignored},
    [S_BF16] = {"bf16", "bf16", S_TOP, bf16_ignored},
};

enum ftype {
    F_INT,   /* int, non-negative integer */
    F_UINT,  /* unsigned, non-negative integer */
    F_U64,   /* uint64_t, non-negative integer */
    F_SIZE,  /* uint64_t bytes: an integer or a size string ("4G") */
    F_BOOL,  /* bool */
    F_ENUM,  /* an enum stored as int, from one of names[] */
    F_PATHS, /* struct config_paths: a string or a list of strings */
    F_FLOAT, /* double, a finite number >= 0 (max, when set, bounds it) */
    F_PAIR,  /* double[2], a list of two numbers in [0, 1) (Adam's betas) */
    F_STR,   /* char[32], a short string */
};

/* field.flags */
#define FL_AUTO 1u /* "auto" is accepted, as Hugging Face's Trainer writes it */
#define FL_CMD 2u  /* not given: the command's own default applies (no DeepSpeed default) */

static const char *const offload_devices[] = {"none", "cpu", "nvme", NULL};
static const char *const device_kinds[] = {"auto", "cuda", "emulated", NULL};
static const char *const io_backends[] = {"auto", "io_uring", "threads", NULL};
static const char *const precisions[] = {"auto", "fp32", "bf16", "fp16", NULL};
static const char *const warmup_types[] = {"log", "linear", NULL};

struct field {
    int sect;
    const char *key;
    const char *alias; /* another name for the same setting, or NULL */
    enum ftype type;
    size_t off;        /* where it is stored in struct zinf_config */
    uint64_t min, max; /* max 0: the storage type's own limit */
    uint64_t multiple; /* 0, or the value must be a multiple of this */
    const char *const *names;
    unsigned flags;    /* FL_* */
    const char *ignored; /* NULL: it acts; else why zinf does not act on it (it is read,
                          * checked and named as ignored, with this) */
};

#define OFF(m) offsetof(struct zinf_config, m)
/* Table order is print order. A row leaves out flags and ignored when they are 0. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
static const struct field fields[] = {
    {S_ZERO, "stage", NULL, F_INT, OFF(zero.stage), 0, 3, 0, NULL, 0,
     "one rank holds every tensor, whatever the stage (zinf launch -n N partitions by it): "
     "offload_param and offload_optimizer say where each lives"},
    {S_ZERO, "overlap_comm", NULL, F_BOOL, OFF(zero.overlap_comm), 0, 0, 0, NULL, FL_CMD,
     "one rank reduces no gradients (zinf launch -n N reduces a block's while the backward "
     "goes on)"},
    {S_ZERO, "reduce_bucket_size", NULL, F_U64, OFF(zero.reduce_bucket_size), 0, 0, 0, NULL,
     FL_AUTO,
     "one rank reduces no gradients (across ranks, overlap_comm needs a block's gradients "
     "to fit)"},
    {S_ZERO, "sub_group_size", NULL, F_U64, OFF(zero.sub_group_size), 0, 0, 0, NULL, 0,
     "the optimizer updates one tensor at a time, whatever the sub-group size"},
    {S_PARAM, "device", NULL, F_ENUM, OFF(zero.offload_param.device), 0, 0, 0, offload_devices},
    {S_PARAM, "nvme_path", NULL, F_PATHS, OFF(zero.offload_param.nvme_path), 0, 0, 0, NULL},
    {S_PARAM, "pin_memory", NULL, F_BOOL, OFF(zero.offload_param.pin_memory), 0, 0, 0, NULL},
    {S_PARAM, "buffer_count", NULL, F_U64, OFF(zero.offload_param.buffer_count), 0, 0, 0, NULL},
    {S_PARAM, "buffer_size", NULL, F_U64, OFF(zero.offload_param.buffer_size), 0, 0, 0, NULL},
    {S_PARAM, "max_in_cpu", NULL, F_U64, OFF(zero.offload_param.max_in_cpu), 0, 0, 0, NULL, 0,
     "what the host tier holds is bounded by zinf.host_bytes"},
    {S_OPTIM, "device", NULL, F_ENUM, OFF(zero.offload_optimizer.device), 0, 0, 0,
     offload_devices},
    {S_OPTIM, "nvme_path", NULL, F_PATHS, OFF(zero.offload_optimizer.nvme_path), 0, 0, 0, NULL},
    {S_OPTIM, "pin_memory", NULL, F_BOOL, OFF(zero.offload_optimizer.pin_memory), 0, 0, 0, NULL},
    {S_OPTIM, "buffer_count", NULL, F_U64, OFF(zero.offload_optimizer.buffer_count), 0, 0, 0,
     NULL, 0, "the staging ring is sized from offload_param's buffers or zinf.staging_bytes"},
    {S_OPTIM, "pipeline_read", NULL, F_BOOL, OFF(zero.offload_optimizer.pipeline_read), 0, 0, 0,
     NULL},
    {S_OPTIM, "pipeline_write", NULL, F_BOOL, OFF(zero.offload_optimizer.pipeline_write), 0, 0,
     0, NULL},
    {S_OPTIM, "fast_init", NULL, F_BOOL, OFF(zero.offload_optimizer.fast_init), 0, 0, 0, NULL, 0,
     "the swap files are not filled at start: zeros are never written"},
    /* DeepSpeed names these prefetch_bucket_size etc. and reads the stage3_ names as
     * aliases; configs in the wild use the stage3_ names, so those are printed. */
    {S_ZERO, "stage3_prefetch_bucket_size", "prefetch_bucket_size", F_U64,
     OFF(zero.stage3_prefetch_bucket_size), 0, 0, 0, NULL, FL_AUTO, NULL},
    {S_ZERO, "stage3_max_live_parameters", "max_live_parameters", F_U64,
     OFF(zero.stage3_max_live_parameters), 0, 0, 0, NULL, 0,
     "what stays on the device is bounded by zinf.device_bytes (across ranks, stage 3 "
     "gathers the next block ahead only when two blocks fit in it)"},
    {S_ZERO, "stage3_max_reuse_distance", "max_reuse_distance", F_U64,
     OFF(zero.stage3_max_reuse_distance), 0, 0, 0, NULL, 0,
     "eviction is by next use in the learned schedule, whatever the distance"},
    /* Given (or "auto"), zinf train homes the weights with fewer elements on the device;
     * not given, none (DeepSpeed's 1e5 would home most of a small model there). */
    {S_ZERO, "stage3_param_persistence_threshold", "param_persistence_threshold", F_U64,
     OFF(zero.stage3_param_persistence_threshold), 0, 0, 0, NULL, FL_AUTO | FL_CMD},
    {S_AIO, "block_size", NULL, F_U64, OFF(aio.block_size), ZINF_ALIGN, 64 * MiB, ZINF_ALIGN,
     NULL},
    {S_AIO, "queue_depth", NULL, F_UINT, OFF(aio.queue_depth), 1, 1024, 0, NULL},
    {S_AIO, "intra_op_parallelism", "thread_count", F_UINT, OFF(aio.intra_op_parallelism), 1, 0,
     0, NULL},
    {S_AIO, "single_submit", NULL, F_BOOL, OFF(aio.single_submit), 0, 0, 0, NULL, 0,
     "zinf.submit_batch says how requests are submitted"},
    {S_AIO, "overlap_events", NULL, F_BOOL, OFF(aio.overlap_events), 0, 0, 0, NULL, 0,
     "submission and completion always overlap: a completion thread per ring"},
    {S_AIO, "use_gds", NULL, F_BOOL, OFF(aio.use_gds), 0, 0, 0, NULL, 0,
     "GPUDirect Storage is not used: NVMe data goes through pinned host buffers"},
    {S_ZINF, "device_bytes", NULL, F_SIZE, OFF(zinf.device_bytes), 0, SIZE_MAX, 0, NULL},
    {S_ZINF, "host_bytes", NULL, F_SIZE, OFF(zinf.host_bytes), 0, SIZE_MAX, 0, NULL},
    {S_ZINF, "nvme_paths", NULL, F_PATHS, OFF(zinf.nvme_paths), 0, 0, 0, NULL},
    {S_ZINF, "device", NULL, F_ENUM, OFF(zinf.device), 0, 0, 0, device_kinds},
    {S_ZINF, "cuda_device", NULL, F_INT, OFF(zinf.cuda_device), 0, 0, 0, NULL},
    {S_ZINF, "sqpoll", NULL, F_BOOL, OFF(zinf.sqpoll), 0, 0, 0, NULL},
    {S_ZINF, "io_backend", NULL, F_ENUM, OFF(zinf.io_backend), 0, 0, 0, io_backends},
    {S_ZINF, "submit_batch", NULL, F_UINT, OFF(zinf.submit_batch), 0, 1024, 0, NULL},
    {S_ZINF, "staging_bytes", NULL, F_SIZE, OFF(zinf.staging_bytes), 0, 4 * GiB, 0, NULL},
    {S_ZINF, "huge_pages", NULL, F_BOOL, OFF(zinf.huge_pages), 0, 0, 0, NULL},
    {S_ZINF, "connect", NULL, F_PATHS, OFF(zinf.connect), 0, 0, 0, NULL},
    {S_ZINF, "job", NULL, F_STR, OFF(zinf.job), 0, 0, 0, NULL},
    {S_ZINF, "comm_timeout", NULL, F_UINT, OFF(zinf.comm_timeout), 1, 86400, 0, NULL},
    /* zinf train's CPU ranks: the emulated device arena in the ranks' shared pool, so that
     * their collectives copy once (false: through the staging areas, twice). */
    {S_ZINF, "comm_pool", NULL, F_BOOL, OFF(zinf.comm_pool), 0, 0, 0, NULL},
    /* `zinf train`'s model and run; its command-line options take precedence. */
    {S_TRAIN, "layers", NULL, F_INT, OFF(zinf.train.layers), 1, 1024, 0, NULL},
    {S_TRAIN, "dim", NULL, F_INT, OFF(zinf.train.dim), 1, 65536, 0, NULL},
    {S_TRAIN, "heads", NULL, F_INT, OFF(zinf.train.heads), 1, 1024, 0, NULL},
    {S_TRAIN, "seq", NULL, F_INT, OFF(zinf.train.seq), 1, 65536, 0, NULL},
    {S_TRAIN, "batch", NULL, F_INT, OFF(zinf.train.batch), 1, 65536, 0, NULL},
    {S_TRAIN, "steps", NULL, F_INT, OFF(zinf.train.steps), 0, 100000000, 0, NULL},
    {S_TRAIN, "seed", NULL, F_U64, OFF(zinf.train.seed), 0, 0x7fffffff, 0, NULL},
    {S_TRAIN, "precision", NULL, F_ENUM, OFF(zinf.train.precision), 0, 0, 0, precisions},
    /* Make the state durable every this many steps (0: only at the end). */
    {S_TRAIN, "checkpoint_every", NULL, F_INT, OFF(zinf.train.checkpoint_every), 0, 100000000,
     0, NULL},
    /* false: a new run's step 0 is not saved, so that until its first checkpoint the swap
     * files hold one copy of the state, not the saved one beside the newest (copy on write). */
    {S_TRAIN, "checkpoint_start", NULL, F_BOOL, OFF(zinf.train.checkpoint_start), 0, 0, 0, NULL},
    /* true (the default): one rank offloaded to NVMe on the CPU updates each tensor just
     * before the next step's forward uses it, rather than every tensor at the end of its
     * step; false: at the end of the step. */
    {S_TRAIN, "update_in_forward", NULL, F_BOOL, OFF(zinf.train.update_in_forward), 0, 0, 0,
     NULL},
    /* `zinf serve`'s limits, as a service shared by a node's users has them. */
    {S_SERVE, "jobs_per_uid", NULL, F_UINT, OFF(zinf.serve.jobs_per_uid), 1, 100000, 0, NULL},
    {S_SERVE, "max_jobs", NULL, F_UINT, OFF(zinf.serve.max_jobs), 1, 100000, 0, NULL},
    {S_SERVE, "sessions_per_uid", NULL, F_UINT, OFF(zinf.serve.sessions_per_uid), 1, 100000, 0,
     NULL},
    {S_SERVE, "connections_per_uid", NULL, F_UINT, OFF(zinf.serve.connections_per_uid), 1,
     100000, 0, NULL},
    {S_SERVE, "max_connections", NULL, F_UINT, OFF(zinf.serve.max_connections), 1, 100000, 0,
     NULL},
    {S_SERVE, "reserved_connections", NULL, F_UINT, OFF(zinf.serve.reserved_connections), 0,
     100000, 0, NULL},
    {S_SERVE, "hello_timeout", NULL, F_UINT, OFF(zinf.serve.hello_timeout), 1, 3600, 0, NULL},
    {S_SERVE, "idle_job_close", NULL, F_UINT, OFF(zinf.serve.idle_job_close), 0, 31 * 86400, 0,
     NULL},
    {S_SERVE, "write_stage_bytes", NULL, F_SIZE, OFF(zinf.serve.write_stage_bytes), MiB,
     SIZE_MAX, 0, NULL},
    {S_SERVE, "stages_per_session", NULL, F_UINT, OFF(zinf.serve.stages_per_session), 1, 65536,
     0, NULL},
    {S_SERVE, "tickets_per_session", NULL, F_UINT, OFF(zinf.serve.tickets_per_session), 1,
     1 << 20, 0, NULL},
    {S_SERVE, "saved_jobs_per_uid", NULL, F_UINT, OFF(zinf.serve.saved_jobs_per_uid), 1, 100000,
     0, NULL},
    {S_SERVE, "swap_bytes_per_uid", NULL, F_SIZE, OFF(zinf.serve.swap_bytes_per_uid), MiB,
     SIZE_MAX, 0, NULL},
    /* DeepSpeed's training keys, which `zinf train` honours. */
    {S_TOP, "train_batch_size", NULL, F_U64, OFF(train.train_batch_size), 1, 0, 0, NULL, FL_AUTO | FL_CMD},
    {S_TOP, "train_micro_batch_size_per_gpu", NULL, F_INT, OFF(train.micro_batch), 1, 65536, 0,
     NULL, FL_AUTO | FL_CMD},
    {S_TOP, "gradient_accumulation_steps", NULL, F_INT, OFF(train.grad_accum), 1, 65536, 0, NULL,
     FL_AUTO | FL_CMD},
    {S_TOP, "gradient_clipping", NULL, F_FLOAT, OFF(train.grad_clip), 0, 0, 0, NULL, FL_AUTO | FL_CMD},
    {S_TOP, "steps_per_print", NULL, F_INT, OFF(train.steps_per_print), 1, 0, 0, NULL, FL_CMD},
    {S_OPT, "type", NULL, F_STR, OFF(train.optimizer.type), 0, 0, 0, NULL, FL_CMD},
    {S_OPT_PARAMS, "lr", NULL, F_FLOAT, OFF(train.optimizer.lr), 0, 0, 0, NULL, FL_AUTO | FL_CMD},
    {S_OPT_PARAMS, "betas", NULL, F_PAIR, OFF(train.optimizer.betas), 0, 0, 0, NULL, FL_AUTO},
    {S_OPT_PARAMS, "eps", NULL, F_FLOAT, OFF(train.optimizer.eps), 0, 0, 0, NULL, FL_AUTO},
    {S_OPT_PARAMS, "weight_decay", NULL, F_FLOAT, OFF(train.optimizer.weight_decay), 0, 0, 0,
     NULL, FL_AUTO},
    {S_OPT_PARAMS, "adam_w_mode", NULL, F_BOOL, OFF(train.optimizer.adam_w_mode), 0, 0, 0, NULL},
    {S_OPT_PARAMS, "bias_correction", NULL, F_BOOL, OFF(train.optimizer.bias_correction), 0, 0, 0,
     NULL},
    {S_OPT_PARAMS, "max_coeff", NULL, F_FLOAT, OFF(train.optimizer.max_coeff), 0, 0, 0, NULL},
    {S_OPT_PARAMS, "min_coeff", NULL, F_FLOAT, OFF(train.optimizer.min_coeff), 0, 0, 0, NULL},
    {S_OPT_PARAMS, "eps_inside_sqrt", NULL, F_BOOL, OFF(train.optimizer.eps_inside_sqrt), 0, 0, 0,
     NULL},
    {S_SCHED, "type", NULL, F_STR, OFF(train.scheduler.type), 0, 0, 0, NULL, FL_CMD},
    {S_SCHED_PARAMS, "warmup_min_lr", NULL, F_FLOAT, OFF(train.scheduler.warmup_min_lr), 0, 0, 0,
     NULL, FL_AUTO},
    {S_SCHED_PARAMS, "warmup_max_lr", NULL, F_FLOAT, OFF(train.scheduler.warmup_max_lr), 0, 0, 0,
     NULL, FL_AUTO},
    {S_SCHED_PARAMS, "warmup_num_steps", NULL, F_INT, OFF(train.scheduler.warmup_num_steps), 0,
     0, 0, NULL, FL_AUTO},
    {S_SCHED_PARAMS, "total_num_steps", NULL, F_INT, OFF(train.scheduler.total_num_steps), 1, 0,
     0, NULL, FL_AUTO | FL_CMD},
    {S_SCHED_PARAMS, "warmup_type", NULL, F_ENUM, OFF(train.scheduler.warmup_type), 0, 0, 0,
     warmup_types},
    {S_SCHED_PARAMS, "warmup_min_ratio", NULL, F_FLOAT, OFF(train.scheduler.warmup_min_ratio), 0,
     0, 0, NULL},
    {S_SCHED_PARAMS, "cos_min_ratio", NULL, F_FLOAT, OFF(train.scheduler.cos_min_ratio), 0, 0, 0,
     NULL},
    {S_SCHED_PARAMS, "lr_range_test_min_lr", NULL, F_FLOAT,
     OFF(train.scheduler.lr_range_test_min_lr), 0, 0, 0, NULL},
    {S_SCHED_PARAMS, "lr_range_test_step_size", NULL, F_INT,
     OFF(train.scheduler.lr_range_test_step_size), 1, 0, 0, NULL},
    {S_SCHED_PARAMS, "lr_range_test_step_rate", NULL, F_FLOAT,
     OFF(train.scheduler.lr_range_test_step_rate), 0, 0, 0, NULL},
    {S_SCHED_PARAMS, "lr_range_test_staircase", NULL, F_BOOL,
     OFF(train.scheduler.lr_range_test_staircase), 0, 0, 0, NULL},
    {S_SCHED_PARAMS, "cycle_min_lr", NULL, F_FLOAT, OFF(train.scheduler.cycle_min_lr), 0, 0, 0,
     NULL},
    {S_SCHED_PARAMS, "cycle_max_lr", NULL, F_FLOAT, OFF(train.scheduler.cycle_max_lr), 0, 0, 0,
     NULL},
    {S_SCHED_PARAMS, "decay_lr_rate", NULL, F_FLOAT, OFF(train.scheduler.decay_lr_rate), 0, 0, 0,
     NULL},
    {S_SCHED_PARAMS, "cycle_first_step_size", NULL, F_INT,
     OFF(train.scheduler.cycle_first_step_size), 1, 0, 0, NULL},
    {S_SCHED_PARAMS, "cycle_second_step_size", NULL, F_INT,
     OFF(train.scheduler.cycle_second_step_size), 0, 0, 0, NULL},
    {S_SCHED_PARAMS, "cycle_first_stair_count", NULL, F_INT,
     OFF(train.scheduler.cycle_first_stair_count), 0, 0, 0, NULL},
    {S_SCHED_PARAMS, "cycle_second_stair_count", NULL, F_INT,
     OFF(train.scheduler.cycle_second_stair_count), 0, 0, 0, NULL},
    {S_SCHED_PARAMS, "decay_step_size", NULL, F_INT, OFF(train.scheduler.decay_step_size), 0, 0,
     0, NULL},
    {S_SCHED_PARAMS, "cycle_momentum", NULL, F_BOOL, OFF(train.scheduler.cycle_momentum), 0, 0, 0,
     NULL},
    {S_SCHED_PARAMS, "cycle_min_mom", NULL, F_FLOAT, OFF(train.scheduler.cycle_min_mom), 0, 0, 0,
     NULL},
    {S_SCHED_PARAMS, "cycle_max_mom", NULL, F_FLOAT, OFF(train.scheduler.cycle_max_mom), 0, 0, 0,
     NULL},
    {S_SCHED_PARAMS, "decay_mom_rate", NULL, F_FLOAT, OFF(train.scheduler.decay_mom_rate), 0, 0,
     0, NULL},
    {S_FP16, "enabled", NULL, F_BOOL, OFF(train.fp16.enabled), 0, 0, 0, NULL, FL_AUTO},
    {S_FP16, "loss_scale", NULL, F_FLOAT, OFF(train.fp16.loss_scale), 0, 0, 0, NULL},
    {S_FP16, "initial_scale_power", NULL, F_INT, OFF(train.fp16.initial_scale_power), 0, 64, 0,
     NULL},
    {S_FP16, "loss_scale_window", NULL, F_INT, OFF(train.fp16.loss_scale_window), 1, 0, 0, NULL},
    {S_FP16, "hysteresis", NULL, F_INT, OFF(train.fp16.hysteresis), 1, 0, 0, NULL},
    {S_FP16, "consecutive_hysteresis", NULL, F_BOOL, OFF(train.fp16.consecutive_hysteresis), 0, 0,
     0, NULL},
    {S_FP16, "min_loss_scale", NULL, F_FLOAT, OFF(train.fp16.min_loss_scale), 0, 0, 0, NULL},
    {S_BF16, "enabled", NULL, F_BOOL, OFF(train.bf16.enabled), 0, 0, 0, NULL, FL_AUTO},
    /* DeepSpeed's deprecated ZeRO-Offload switches, last: finish() maps them. */
    {S_ZERO, "cpu_offload", NULL, F_BOOL, OFF(zero.cpu_offload), 0, 0, 0, NULL},
    {S_ZERO, "cpu_offload_param", "cpu_offload_params", F_BOOL, OFF(zero.cpu_offload_param), 0, 0,
     0, NULL},
    {S_ZERO, "cpu_offload_use_pin_memory", NULL, F_BOOL, OFF(zero.cpu_offload_use_pin_memory), 0,
     0, 0, NULL, 0,
     "DeepSpeed reads it no more: pin_memory in offload_param or offload_optimizer pins"},
};
#pragma GCC diagnostic pop
_Static_assert(ARRAY_SIZE(fields) <= 128, "struct zinf_config.given has one bit per field");

#define FIELD_STAGE 0 /* fields[0]: set by the deprecated "zero_optimization": true|false */

struct parser {
    struct zinf_config *c;
    const char *name; /* the file or buffer name, for warnings */
    bool quiet;       /* CONFIG_PARSE_QUIET: unknown keys are listed, not logged */
    char *err;
    size_t errlen;
};

/* ---- small helpers ---------------------------------------------------------------- */

static void *field_ptr(struct zinf_config *c, const struct field *f)
{
    return (char *)c + f->off;
}

static const void *field_cptr(const struct zinf_config *c, const struct field *f)
{
    return (const char *)c + f->off;
}

static size_t field_index(const struct field *f)
{
    return (size_t)(f - fields);
}

static bool bit_get(const uint64_t *mask, const struct field *f)
{
    return mask[field_index(f) / 64] >> (field_index(f) % 64) & 1;
}

static void bit_set(uint64_t *mask, const struct field *f)
{
    mask[field_index(f) / 64] |= 1ull << (field_index(f) % 64);
}

static uint64_t type_max(const struct field *f)
{
    if (f->max)
        return f->max;
    switch (f->type) {
    case F_INT: return INT_MAX;
    case F_UINT: return UINT_MAX;
    case F_U64: return INT64_MAX; /* what a JSON integer can say; 1e19 says more */
    default: return UINT64_MAX;
    }
}

/* Append s to dst (size n, NUL-terminated, length *len), escaping control bytes, quotes
 * and backslashes as \xNN so that whatever the input, a message stays one line. At most
 * max bytes of s are shown; a longer s ends in "...". */
static void append_escaped(char *dst, size_t n, size_t *len, const char *s, size_t slen,
                           size_t max)
{
    static const char hex[] = "0123456789abcdef";
    size_t shown = slen > max ? max : slen;

    for (size_t i = 0; i < shown && *len + 5 < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x20 || ch == 0x7f || ch == '"' || ch == '\\') {
            dst[(*len)++] = '\\';
            dst[(*len)++] = 'x';
            dst[(*len)++] = hex[ch >> 4];
            dst[(*len)++] = hex[ch & 15];
        } else {
            dst[(*len)++] = (char)ch;
        }
    }
    if (shown < slen && *len + 4 < n) {
        memcpy(dst + *len, "...", 3);
        *len += 3;
    }
    dst[*len] = '\0';
}

/* dst = parent "." key (or key alone at the top), with the key escaped and cut short. */
static void join_path(char *dst, size_t n, const char *parent, const char *key)
{
    size_t len = 0;

    dst[0] = '\0';
    if (parent) {
        len = strlen(parent);
        if (len + 2 > n)
            len = n - 2;
        memcpy(dst, parent, len);
        dst[len++] = '.';
        dst[len] = '\0';
    }
    append_escaped(dst, n, &len, key, strlen(key), KEY_SHOWN_BYTES);
}

static const char *type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "a list";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* A JSON string for a message: quoted, escaped, at most 64 bytes shown. */
static const char *quoted(const json_t *v, char *buf, size_t n)
{
    size_t len = 1;

    buf[0] = '"';
    buf[1] = '\0';
    append_escaped(buf, n - 1, &len, json_string_value(v), json_string_length(v), 64);
    buf[len++] = '"';
    buf[len] = '\0';
    return buf;
}

/* Make every byte of a message printable, so that it is one line whatever produced it. */
static void one_line(char *s)
{
    for (; s && *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f)
            *s = '?';
}

__attribute__((format(printf, 3, 4))) static int fail(struct parser *p, const char *path,
                                                      const char *fmt, ...)
{
    va_list ap;
    int n = 0;

    if (!p->err || !p->errlen)
        return -EINVAL;
    if (path)
        n = snprintf(p->err, p->errlen, "%s: ", path);
    if (n >= 0 && (size_t)n < p->errlen) {
        va_start(ap, fmt);
        vsnprintf(p->err + n, p->errlen - (size_t)n, fmt, ap);
        va_end(ap);
    }
    return -EINVAL;
}

static int fail_nomem(struct parser *p)
{
    if (p->err && p->errlen)
        snprintf(p->err, p->errlen, "%s: out of memory", p->name ? p->name : "config");
    return -ENOMEM;
}

/* Append an owned copy of s to a growing list (capacity doubles at powers of two). */
static int list_push(char ***list, size_t *n, const char *s)
{
    if ((*n & (*n - 1)) == 0) {
        size_t cap = *n < 4 ? 4 : *n * 2;
        char **l = realloc(*list, cap * sizeof(*l));
        if (!l)
            return -ENOMEM;
        *list = l;
    }
    char *d = strdup(s);
    if (!d)
        return -ENOMEM;
    (*list)[(*n)++] = d;
    return 0;
}

static void list_free(char ***list, size_t *n)
{
    for (size_t i = 0; i < *n; i++)
        free((*list)[i]);
    free(*list);
    *list = NULL;
    *n = 0;
}

static void paths_free(struct config_paths *ps)
{
    for (unsigned i = 0; i < ps->count; i++)
        free(ps->path[i]);
    memset(ps, 0, sizeof(*ps));
}


/* ---- numbers ------------------------------------------------------------------------ */

static int range_error(struct parser *p, const char *path, const struct field *f,
                       const char *got, bool negative, bool too_big)
{
    bool bounded = f->max != 0 && !(f->type == F_SIZE && f->max == SIZE_MAX);

    if (bounded)
        return fail(p, path, "must be between %llu and %llu, got %s",
                    (unsigned long long)f->min, (unsigned long long)f->max, got);
    if (too_big)
        return fail(p, path, "is too large, got %s", got);
    if (negative && f->min == 0)
        return fail(p, path, "must be non-negative, got %s", got);
    return fail(p, path, "must be at least %llu, got %s", (unsigned long long)f->min, got);
}

/* Read a non-negative integer setting: a JSON integer, an integral real (1e8), or for
 * F_SIZE a size string ("4G"); then its range and multiple. */
static int read_uint(struct parser *p, const char *path, const struct field *f, json_t *v,
                     uint64_t *out)
{
    char got[96];
    uint64_t u;
    bool negative = false;

    if (json_is_integer(v)) {
        json_int_t i = json_integer_value(v);
        snprintf(got, sizeof(got), "%" JSON_INTEGER_FORMAT, i);
        negative = i < 0;
        u = negative ? 0 : (uint64_t)i;
    } else if (json_is_real(v)) {
        double d = json_real_value(v);
        snprintf(got, sizeof(got), "%g", d);
        if (d != floor(d))
            return fail(p, path, "must be an integer, got %s", got);
        negative = d < 0;
        if (d >= 18446744073709551616.0)
            return range_error(p, path, f, got, false, true);
        u = negative ? 0 : (uint64_t)d;
    } else if (json_is_string(v) && f->type == F_SIZE) {
        quoted(v, got, sizeof(got));
        int ret = strlen(json_string_value(v)) == json_string_length(v)
                      ? parse_size(json_string_value(v), &u)
                      : -EINVAL;
        if (ret == -ERANGE)
            return range_error(p, path, f, got, false, true);
        if (ret < 0)
            return fail(p, path, "must be a size like \"4G\", \"512M\" or a number of bytes, got %s",
                        got);
    } else if (f->type == F_SIZE) {
        return fail(p, path, "must be an integer or a size string like \"4G\", got %s",
                    type_name(v));
    } else if (json_is_string(v) && !strcmp(json_string_value(v), "auto")) {
        return fail(p, path, "must be an integer, got \"auto\" (taken only where Hugging Face's "
                    "DeepSpeed integration fills the value in)");
    } else {
        return fail(p, path, "must be an integer, got %s", type_name(v));
    }
    if (!negative && f->multiple && u % f->multiple)
        return fail(p, path, "must be a multiple of %llu, got %s",
                    (unsigned long long)f->multiple, got);
    if (negative || u < f->min || u > type_max(f))
        return range_error(p, path, f, got, negative, !negative && u > type_max(f));
    *out = u;
    return 0;
}

/* A finite number >= 0 (and at most max, when it has one). */
static int read_float(struct parser *p, const char *path, const struct field *f, json_t *v,
                      double *out)
{
    if (!json_is_number(v))
        return fail(p, path, "must be a number%s, got %s",
                    f->flags & FL_AUTO ? " (or \"auto\")" : "", type_name(v));
    double d = json_number_value(v);
    if (!isfinite(d) || d < 0)
        return fail(p, path, "must be a number >= 0, got %g", d);
    if (f->max && d > (double)f->max)
        return fail(p, path, "must be at most %llu, got %g", (unsigned long long)f->max, d);
    *out = d;
    return 0;
}

/* ---- paths -------------------------------------------------------------------------- */

static int add_path(struct parser *p, const char *path, json_t *v, struct config_paths *dst)
{
    size_t len = json_string_length(v);
    const char *s = json_string_value(v);

    if (len == 0)
        return fail(p, path, "must not be empty");
    if (strlen(s) != len)
        return fail(p, path, "must not contain a NUL byte");
    if (len > MAX_PATH_BYTES)
        return fail(p, path, "is too long, %zu bytes (at most %d)", len, MAX_PATH_BYTES);
    if (dst->count >= CONFIG_MAX_NVME_PATHS)
        return fail(p, path, "too many paths (at most %d)", CONFIG_MAX_NVME_PATHS);
    char *d = strdup(s);
    if (!d)
        return fail_nomem(p);
    dst->path[dst->count++] = d;
    return 0;
}

static int read_paths(struct parser *p, const char *path, json_t *v, struct config_paths *dst)
{
    char elem[JSON_PATH_CHARS + 32];
    size_t i;
    json_t *e;

    if (json_is_string(v))
        return add_path(p, path, v, dst);
    if (!json_is_array(v))
        return fail(p, path, "must be a string or a list of strings, got %s", type_name(v));
    if (json_array_size(v) > CONFIG_MAX_NVME_PATHS)
        return fail(p, path, "too many paths, got %zu (at most %d)", json_array_size(v),
                    CONFIG_MAX_NVME_PATHS);
    json_array_foreach(v, i, e) {
        snprintf(elem, sizeof(elem), "%s[%zu]", path, i);
        if (!json_is_string(e))
            return fail(p, elem, "must be a string, got %s", type_name(e));
        int ret = add_path(p, elem, e, dst);
        if (ret)
            return ret;
    }
    return 0;
}

/* ---- settings and sections ---------------------------------------------------------- */

static int read_field(struct parser *p, const struct field *f, const char *path,
                      const char *key, json_t *v)
{
    struct zinf_config *c = p->c;
    void *dst = field_ptr(c, f);
    uint64_t u = 0;
    int ret;

    if (bit_get(c->given, f)) {
        /* Only an alias can get here: jansson refuses a key given twice. */
        const char *other = strcmp(key, f->key) ? f->key : f->alias;
        if (!other) /* the same key in a section given under two names */
            return fail(p, path, "given twice: \"bf16\" and \"bfloat16\" are one section");
        return fail(p, path, "given twice, also as %s", other);
    }
    if ((f->flags & FL_AUTO) && json_is_string(v) && !strcmp(json_string_value(v), "auto")) {
        /* Hugging Face's Trainer fills these in; config_resolve_auto() does here. */
        bit_set(c->autos, f);
        goto given;
    }
    switch (f->type) {
    case F_INT:
    case F_UINT:
    case F_U64:
    case F_SIZE:
        ret = read_uint(p, path, f, v, &u);
        if (ret)
            return ret;
        if (f->type == F_INT)
            *(int *)dst = (int)u;
        else if (f->type == F_UINT)
            *(unsigned *)dst = (unsigned)u;
        else
            *(uint64_t *)dst = u;
        break;
    case F_BOOL:
        if (!json_is_boolean(v))
            return fail(p, path, "must be true or false, got %s", type_name(v));
        *(bool *)dst = json_is_true(v);
        break;
    case F_ENUM: {
        char list[128], got[96];
        size_t len = 0;
        int i;

        list[0] = '\0';
        for (i = 0; f->names[i]; i++)
            len += (size_t)snprintf(list + len, sizeof(list) - len, "%s\"%s\"", i ? ", " : "",
                                    f->names[i]);
        if (!json_is_string(v))
            return fail(p, path, "must be one of %s, got %s", list, type_name(v));
        for (i = 0; f->names[i]; i++)
            if (!strcmp(json_string_value(v), f->names[i]) &&
                strlen(f->names[i]) == json_string_length(v))
                break;
        if (!f->names[i])
            return fail(p, path, "must be one of %s, got %s", list, quoted(v, got, sizeof(got)));
        /* Each enum here is int-sized and its values are 0..n-1. */
        *(int *)dst = i;
        break;
    }
    case F_PATHS:
        if (json_is_null(v))
            return 0; /* DeepSpeed's "nvme_path": null, the same as leaving it out */
        ret = read_paths(p, path, v, dst);
        if (ret)
            return ret;
        break;
    case F_FLOAT:
        if ((ret = read_float(p, path, f, v, dst)) != 0)
            return ret;
        break;
    case F_PAIR: {
        double pair[2];
        char elem[JSON_PATH_CHARS + 8];
        if (!json_is_array(v) || json_array_size(v) != 2)
            return fail(p, path, "must be a list of two numbers%s, got %s",
                        f->flags & FL_AUTO ? " (or \"auto\")" : "",
                        json_is_array(v) ? "a list of another length" : type_name(v));
        for (size_t i = 0; i < 2; i++) {
            snprintf(elem, sizeof(elem), "%s[%zu]", path, i);
            json_t *e = json_array_get(v, i);
            if (!json_is_number(e))
                return fail(p, elem, "must be a number, got %s", type_name(e));
            pair[i] = json_number_value(e);
            if (!(pair[i] >= 0 && pair[i] < 1))
                return fail(p, elem, "must be in [0, 1), got %g", pair[i]);
        }
        memcpy(dst, pair, sizeof(pair));
        break;
    }
    case F_STR: {
        char got[96];
        if (!json_is_string(v))
            return fail(p, path, "must be a string, got %s", type_name(v));
        size_t len = json_string_length(v);
        if (len == 0 || len >= 32 || strlen(json_string_value(v)) != len)
            return fail(p, path, "must be a name of 1 to 31 characters, got %s",
                        quoted(v, got, sizeof(got)));
        memcpy(dst, json_string_value(v), len + 1);
        break;
    }
    }
given:
    bit_set(c->given, f);
    if (f->ignored) {
        /* Read and checked, but zinf does not act on it: named, with why. */
        char line[JSON_PATH_CHARS + 160];
        snprintf(line, sizeof(line), "%s (%s)", path, f->ignored);
        if (list_push(&c->ignored, &c->n_ignored, line))
            return fail_nomem(p);
    }
    return 0;
}

static const struct field *find_field(int s, const char *key)
{
    for (size_t i = 0; i < ARRAY_SIZE(fields); i++)
        if (fields[i].sect == s &&
            (!strcmp(fields[i].key, key) || (fields[i].alias && !strcmp(fields[i].alias, key))))
            return &fields[i];
    return NULL;
}

static int find_sub(int s, const char *key)
{
    for (int i = 0; i < S_COUNT; i++)
        if (sects[i].parent == s && !strcmp(sects[i].key, key))
            return i;
    /* DeepSpeed's older name for its bf16 section. */
    if (s == S_TOP && !strcmp(key, "bfloat16"))
        return S_BF16;
    return -1;
}

/* A likely meant name for an unknown key: the same name in another section (written as a
 * full path), else a close spelling of a name this section knows. NULL when none. */
static const char *suggest(int s, const char *key, char *buf, size_t n)
{
    const char *best = NULL;
    unsigned best_d = 3;

    for (size_t i = 0; i < ARRAY_SIZE(fields); i++) {
        const struct field *f = &fields[i];
        if (f->sect != s && (!strcmp(f->key, key) || (f->alias && !strcmp(f->alias, key)))) {
            snprintf(buf, n, "%s.%s", sects[f->sect].path, f->key);
            return buf;
        }
    }
    for (int i = 1; i < S_COUNT; i++) {
        if (sects[i].parent != s && !strcmp(sects[i].key, key)) {
            snprintf(buf, n, "%s", sects[i].path);
            return buf;
        }
    }
    if (strlen(key) < 4)
        return NULL;
    for (size_t i = 0; i < ARRAY_SIZE(fields); i++) {
        if (fields[i].sect != s)
            continue;
        unsigned d = edit_distance(key, fields[i].key, 3);
        if (d < best_d) {
            best_d = d;
            best = fields[i].key;
        }
    }
    for (int i = 1; i < S_COUNT; i++) {
        if (sects[i].parent == s) {
            unsigned d = edit_distance(key, sects[i].key, 3);
            if (d < best_d) {
                best_d = d;
                best = sects[i].key;
            }
        }
    }
    if (!best)
        return NULL;
    snprintf(buf, n, "%s", best);
    return buf;
}

static int parse_section(struct parser *p, int s, json_t *obj);

static int parse_subsection(struct parser *p, int sub, const char *path, json_t *v)
{
    if (json_is_null(v))
        return 0; /* "offload_param": null is DeepSpeed's way of saying "none" */
    if (sub == S_ZERO && json_is_boolean(v)) {
        /* DeepSpeed's deprecated form: true is stage 1, false is stage 0. */
        p->c->zero.stage = json_is_true(v) ? 1 : 0;
        bit_set(p->c->given, &fields[FIELD_STAGE]);
        return 0;
    }
    if (!json_is_object(v))
        return fail(p, path, "must be an object, got %s", type_name(v));
    return parse_section(p, sub, v);
}

/* Why key is in an ignored list (NULL: it is not). */
static const char *ignored_why(const struct ignored_key *list, const char *key)
{
    for (; list && list->key; list++)
        if (!strcmp(list->key, key))
            return list->why;
    return NULL;
}

static int note_unknown(struct parser *p, int s, const char *path, const char *key)
{
    struct zinf_config *c = p->c;
    char hint[JSON_PATH_CHARS];

    if (list_push(&c->unknown, &c->n_unknown, path))
        return fail_nomem(p);
    if (p->quiet)
        return 0;
    /* A section one level off (aio inside zero_optimization, as some guides have it): say
     * where it belongs. DeepSpeed ignores it there too. */
    for (int i = 1; i < S_COUNT; i++) {
        if (sects[i].parent != s && !strcmp(sects[i].key, key) && sects[i].parent >= 0) {
            int up = sects[i].parent;
            log_warn("%s%s%s: unknown key, ignored: %s belongs %s%s%s; move it there",
                     p->name ? p->name : "",
                     p->name ? ": " : "", path, key, up == S_TOP ? "at the top level" : "in ",
                     up == S_TOP ? "" : sects[up].path,
                     up == S_TOP ? " of the config (DeepSpeed reads it only there)" : "");
            return 0;
        }
    }
    const char *sug = suggest(s, key, hint, sizeof(hint));
    log_warn("%s%s%s: unknown key, ignored%s%s%s", p->name ? p->name : "", p->name ? ": " : "",
             path, sug ? " (did you mean \"" : "", sug ? sug : "", sug ? "\"?)" : "");
    return 0;
}

static int parse_section(struct parser *p, int s, json_t *obj)
{
    struct zinf_config *c = p->c;
    const char *key;
    json_t *v;
    int ret = 0;

    json_object_foreach(obj, key, v) {
        char path[JSON_PATH_CHARS];
        const struct field *f;
        const char *why;
        int sub;

        join_path(path, sizeof(path), sects[s].path, key);
        if ((f = find_field(s, key)))
            ret = read_field(p, f, path, key, v);
        else if ((sub = find_sub(s, key)) >= 0)
            ret = parse_subsection(p, sub, path, v);
        else if ((why = ignored_why(sects[s].ignored, key))) {
            char line[JSON_PATH_CHARS + 160];
            snprintf(line, sizeof(line), "%s (%s)", path, why);
            ret = list_push(&c->ignored, &c->n_ignored, line) ? fail_nomem(p) : 0;
        }
        else
            ret = note_unknown(p, s, path, key);
        if (ret)
            return ret;
    }
    return 0;
}

/* ---- what the settings imply -------------------------------------------------------- */

/* A directory without its trailing slashes, so "/mnt/a/" and "/mnt/a" are one drive. */
static size_t trimmed_len(const char *s)
{
    size_t len = strlen(s);
    while (len > 1 && s[len - 1] == '/')
        len--;
    return len;
}

static int merge_paths(struct parser *p, const char *path, const struct config_paths *src)
{
    struct config_paths *all = &p->c->nvme_paths;

    for (unsigned i = 0; i < src->count; i++) {
        size_t len = trimmed_len(src->path[i]);
        bool dup = false;
        for (unsigned j = 0; j < all->count && !dup; j++)
            dup = strlen(all->path[j]) == len && !memcmp(all->path[j], src->path[i], len);
        if (dup)
            continue;
        if (all->count >= CONFIG_MAX_NVME_PATHS)
            return fail(p, path,
                        "too many NVMe paths: more than %d distinct directories over "
                        "zinf.nvme_paths and the offload sections",
                        CONFIG_MAX_NVME_PATHS);
        char *d = strndup(src->path[i], len);
        if (!d)
            return fail_nomem(p);
        all->path[all->count++] = d;
    }
    return 0;
}

static const struct field *field_by_path(const char *json_path)
{
    for (size_t i = 0; i < ARRAY_SIZE(fields); i++) {
        const char *sp = sects[fields[i].sect].path;
        size_t n = sp ? strlen(sp) : 0;
        if (sp && (strncmp(json_path, sp, n) || json_path[n] != '.'))
            continue;
        if (!strcmp(json_path + (sp ? n + 1 : 0), fields[i].key))
            return &fields[i];
    }
    return NULL;
}

/* Was any setting of section s given? */
static bool sect_given(const struct zinf_config *c, int s)
{
    for (size_t i = 0; i < ARRAY_SIZE(fields); i++)
        if (fields[i].sect == s && bit_get(c->given, &fields[i]))
            return true;
    return false;
}

static int finish(struct parser *p)
{
    struct zinf_config *c = p->c;
    /* DeepSpeed's deprecated cpu_offload and cpu_offload_param, as it maps them: each is
     * its section with device "cpu", and refused beside that section. */
    const struct {
        bool on;
        const char *key;
        int sect;
        enum config_offload_device *dst;
    } legacy[] = {
        {c->zero.cpu_offload, "cpu_offload", S_OPTIM, &c->zero.offload_optimizer.device},
        {c->zero.cpu_offload_param, "cpu_offload_param", S_PARAM, &c->zero.offload_param.device},
    };
    for (size_t i = 0; i < ARRAY_SIZE(legacy); i++) {
        if (!legacy[i].on)
            continue;
        if (sect_given(c, legacy[i].sect)) {
            char key[64];
            snprintf(key, sizeof(key), "zero_optimization.%s", legacy[i].key);
            return fail(p, key,
                        "deprecated, and %s is given too (DeepSpeed refuses both): keep %s",
                        sects[legacy[i].sect].path, sects[legacy[i].sect].path);
        }
        *legacy[i].dst = CONFIG_OFFLOAD_CPU;
        char dev[64];
        snprintf(dev, sizeof(dev), "%s.device", sects[legacy[i].sect].path);
        bit_set(c->given, field_by_path(dev)); /* the config's, not a default */
    }

    const struct {
        int sect;
        enum config_offload_device device;
        const struct config_paths *paths;
    } offload[] = {
        {S_PARAM, c->zero.offload_param.device, &c->zero.offload_param.nvme_path},
        {S_OPTIM, c->zero.offload_optimizer.device, &c->zero.offload_optimizer.nvme_path},
    };
    char path[JSON_PATH_CHARS];
    int ret;

    /* DeepSpeed needs nvme_path with device "nvme"; zinf.nvme_paths can stand in for it,
     * and through a daemon (zinf.connect) the swap directories are the daemon's. */
    for (size_t i = 0; i < ARRAY_SIZE(offload); i++) {
        snprintf(path, sizeof(path), "%s.nvme_path", sects[offload[i].sect].path);
        if (offload[i].device == CONFIG_OFFLOAD_NVME && !offload[i].paths->count &&
            !c->zinf.nvme_paths.count && !c->zinf.connect.count)
            return fail(p, path, "required when device is \"nvme\"");
    }
    ret = merge_paths(p, "zinf.nvme_paths", &c->zinf.nvme_paths);
    /* An offload section's directories are used only when it offloads to NVMe, as in
     * DeepSpeed, which ignores nvme_path for the other devices. */
    for (size_t i = 0; i < ARRAY_SIZE(offload) && !ret; i++) {
        snprintf(path, sizeof(path), "%s.nvme_path", sects[offload[i].sect].path);
        if (offload[i].device == CONFIG_OFFLOAD_NVME)
            ret = merge_paths(p, path, offload[i].paths);
    }
    if (ret)
        return ret;
    for (unsigned i = 1; i < c->nvme_paths.count; i++)
        c->nvme_paths_extra[i - 1] = c->nvme_paths.path[i];
    return 0;
}

/* ---- the interface ------------------------------------------------------------------ */

void config_defaults(struct zinf_config *c)
{
    memset(c, 0, sizeof(*c));
    c->zero.stage = 0;
    c->zero.sub_group_size = 1000000000;
    c->zero.offload_param.device = CONFIG_OFFLOAD_NONE;
    c->zero.offload_param.buffer_count = 5;
    c->zero.offload_param.buffer_size = 100000000;
    c->zero.offload_param.max_in_cpu = 1000000000;
    c->zero.offload_optimizer.device = CONFIG_OFFLOAD_NONE;
    c->zero.offload_optimizer.buffer_count = 4;
    /* DeepSpeed's are off; zinf's are on (the optimizer reads ahead and writes behind). */
    c->zero.offload_optimizer.pipeline_read = true;
    c->zero.offload_optimizer.pipeline_write = true;
    c->zero.stage3_prefetch_bucket_size = 50000000;
    c->zero.reduce_bucket_size = 500000000;
    c->zero.stage3_max_live_parameters = 1000000000;
    c->zero.stage3_max_reuse_distance = 1000000000;
    c->zero.stage3_param_persistence_threshold = 100000;
    c->aio.block_size = 1048576;
    c->aio.queue_depth = 8;
    c->aio.intra_op_parallelism = 1;
    c->aio.single_submit = false;
    c->aio.overlap_events = true;
    c->aio.use_gds = false;
    c->zinf.device = ZINF_DEVICE_AUTO;
    c->zinf.io_backend = CONFIG_IO_AUTO;
    c->zinf.huge_pages = true;
    c->zinf.train.checkpoint_start = true;
    c->zinf.train.update_in_forward = true;
    c->zinf.comm_pool = true;
    c->zinf.comm_timeout = 1800;
    c->zinf.serve.jobs_per_uid = 4;
    c->zinf.serve.max_jobs = 64;
    c->zinf.serve.sessions_per_uid = 64;
    c->zinf.serve.connections_per_uid = 256;
    c->zinf.serve.max_connections = 1024;
    c->zinf.serve.reserved_connections = 16;
    c->zinf.serve.hello_timeout = 10;
    c->zinf.serve.idle_job_close = 600;
    c->zinf.serve.write_stage_bytes = GiB;
    c->zinf.serve.stages_per_session = 64;
    c->zinf.serve.tickets_per_session = 16384;
    c->zinf.serve.saved_jobs_per_uid = 256;
    c->zinf.serve.swap_bytes_per_uid = 1024 * GiB;
    /* DeepSpeed's (FusedAdam's, its schedulers', its fp16 loss scaler's) defaults. */
    c->train.optimizer.betas[0] = 0.9;
    c->train.optimizer.betas[1] = 0.999;
    c->train.optimizer.eps = 1e-8;
    c->train.optimizer.adam_w_mode = true;
    c->train.optimizer.bias_correction = true;
    c->train.optimizer.max_coeff = 10.0;
    c->train.optimizer.min_coeff = 0.01;
    c->train.scheduler.cycle_first_step_size = 2000;
    c->train.scheduler.cycle_momentum = true;
    c->train.scheduler.cycle_min_mom = 0.8;
    c->train.scheduler.cycle_max_mom = 0.9;
    c->train.scheduler.warmup_max_lr = 0.001;
    c->train.scheduler.warmup_num_steps = 1000;
    c->train.scheduler.cos_min_ratio = 0.0001;
    c->train.scheduler.lr_range_test_min_lr = 1e-3;
    c->train.scheduler.lr_range_test_step_size = 2000;
    c->train.scheduler.lr_range_test_step_rate = 1.0;
    c->train.fp16.initial_scale_power = 16;
    c->train.fp16.loss_scale_window = 1000;
    c->train.fp16.hysteresis = 2;
    c->train.fp16.min_loss_scale = 1;
}


bool config_given(const struct zinf_config *c, const char *json_path)
{
    const struct field *f = field_by_path(json_path);
    return f && bit_get(c->given, f);
}

bool config_is_auto(const struct zinf_config *c, const char *json_path)
{
    const struct field *f = field_by_path(json_path);
    return f && bit_get(c->autos, f);
}

/* Set an "auto" field to v and say so: "path = v" on a line of its own. */
static void resolve(struct zinf_config *c, const char *json_path, double v, char *out,
                    size_t outlen, size_t *len)
{
    const struct field *f = field_by_path(json_path);
    if (!f || !bit_get(c->autos, f))
        return;
    void *dst = (char *)c + f->off;
    switch (f->type) {
    case F_INT: *(int *)dst = (int)v; break;
    case F_U64: *(uint64_t *)dst = (uint64_t)v; break;
    case F_BOOL: *(bool *)dst = v != 0; break;
    case F_FLOAT: *(double *)dst = v; break;
    default: return; /* F_PAIR is set by the caller */
    }
    c->autos[field_index(f) / 64] &= ~(1ull << (field_index(f) % 64));
    if (*len < outlen) {
        if (f->type == F_BOOL)
            *len += (size_t)snprintf(out + *len, outlen - *len, "%s%s = %s", *len ? "\n" : "",
                                     json_path, v != 0 ? "true" : "false");
        else
            *len += (size_t)snprintf(out + *len, outlen - *len, "%s%s = %.7g", *len ? "\n" : "",
                                     json_path, v);
    }
}

void config_resolve_auto(struct zinf_config *c, const struct config_auto_inputs *in, char *out,
                         size_t outlen)
{
    size_t len = 0;
    double d = in->hidden_size;
    if (outlen)
        out[0] = '\0';
    /* As transformers' integrations/deepspeed.py fills them in. */
    resolve(c, "train_micro_batch_size_per_gpu", in->micro_batch, out, outlen, &len);
    resolve(c, "gradient_accumulation_steps", in->grad_accum, out, outlen, &len);
    resolve(c, "train_batch_size", (double)in->micro_batch * in->grad_accum, out, outlen, &len);
    resolve(c, "gradient_clipping", in->grad_clip, out, outlen, &len);
    resolve(c, "optimizer.params.lr", in->lr, out, outlen, &len);
    resolve(c, "optimizer.params.eps", 1e-8, out, outlen, &len);
    resolve(c, "optimizer.params.weight_decay", in->weight_decay, out, outlen, &len);
    const struct field *b = field_by_path("optimizer.params.betas");
    if (bit_get(c->autos, b)) {
        c->train.optimizer.betas[0] = 0.9;
        c->train.optimizer.betas[1] = 0.999;
        c->autos[field_index(b) / 64] &= ~(1ull << (field_index(b) % 64));
        if (len < outlen)
            len += (size_t)snprintf(out + len, outlen - len, "%soptimizer.params.betas = [0.9, "
                                    "0.999]", len ? "\n" : "");
    }
    resolve(c, "scheduler.params.warmup_min_lr", 0, out, outlen, &len);
    resolve(c, "scheduler.params.warmup_max_lr", in->lr, out, outlen, &len);
    resolve(c, "scheduler.params.warmup_num_steps", 0, out, outlen, &len);
    resolve(c, "scheduler.params.total_num_steps", in->steps, out, outlen, &len);
    resolve(c, "fp16.enabled", in->fp16 > 0, out, outlen, &len);
    if (in->bf16 >= 0)
        resolve(c, "bf16.enabled", in->bf16, out, outlen, &len);
    /* transformers' formulas, from the model's hidden size. */
    resolve(c, "zero_optimization.stage3_prefetch_bucket_size", floor(0.9 * d * d), out, outlen,
            &len);
    resolve(c, "zero_optimization.stage3_param_persistence_threshold", 10 * d, out, outlen, &len);
    resolve(c, "zero_optimization.reduce_bucket_size", d * d, out, outlen, &len);
}

void config_free(struct zinf_config *c)
{
    if (!c)
        return;
    paths_free(&c->zero.offload_param.nvme_path);
    paths_free(&c->zero.offload_optimizer.nvme_path);
    paths_free(&c->zinf.nvme_paths);
    paths_free(&c->zinf.connect);
    paths_free(&c->nvme_paths);
    list_free(&c->unknown, &c->n_unknown);
    list_free(&c->ignored, &c->n_ignored);
    config_defaults(c);
}

int config_parse_buffer(const char *buf, size_t len, const char *name, struct zinf_config *c,
                        char *err, size_t errlen)
{
    return config_parse_buffer_flags(buf, len, name, c, 0, err, errlen);
}

int config_parse_buffer_flags(const char *buf, size_t len, const char *name,
                              struct zinf_config *c, unsigned flags, char *err, size_t errlen)
{
    struct parser p = {.c = c, .name = name, .quiet = flags & CONFIG_PARSE_QUIET, .err = err,
                       .errlen = errlen};
    json_error_t je;
    json_t *root;
    int ret;

    if (err && errlen)
        err[0] = '\0';
    if (!c)
        return -EINVAL;
    config_defaults(c);
    if (!buf && len)
        return fail(&p, name ? name : "config", "no buffer");
    root = json_loadb(buf ? buf : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        if (err && errlen) {
            if (je.line > 0)
                snprintf(err, errlen, "%s:%d:%d: %s", name ? name : "config", je.line, je.column,
                         je.text);
            else
                snprintf(err, errlen, "%s: %s", name ? name : "config", je.text);
            one_line(err);
        }
        return -EINVAL;
    }
    if (!json_is_object(root))
        ret = fail(&p, "top level", "must be an object, got %s", type_name(root));
    else
        ret = parse_section(&p, S_TOP, root);
    if (!ret)
        ret = finish(&p);
    json_decref(root);
    if (ret) {
        config_free(c);
        if (err && errlen)
            one_line(err);
    }
    return ret;
}

int config_parse_file(const char *path, struct zinf_config *c, char *err, size_t errlen)
{
    return config_parse_file_flags(path, c, 0, err, errlen);
}

int config_parse_file_flags(const char *path, struct zinf_config *c, unsigned flags, char *err,
                            size_t errlen)
{
    struct stat st;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int fd, ret;

    if (err && errlen)
        err[0] = '\0';
    if (!c)
        return -EINVAL;
    config_defaults(c);
    if (!path) {
        ret = -EINVAL;
        goto err;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        ret = -errno;
        goto err;
    }
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        ret = -EISDIR;
        goto err_close;
    }
    /* Read to the end rather than trust st_size, so that pipes (/dev/stdin) work too. */
    for (;;) {
        if (len == cap) {
            if (cap >= MAX_FILE_BYTES) {
                ret = -EFBIG;
                goto err_close;
            }
            size_t ncap = cap ? cap * 2 : 64 * KiB;
            char *nbuf = realloc(buf, ncap);
            if (!nbuf) {
                ret = -ENOMEM;
                goto err_close;
            }
            buf = nbuf;
            cap = ncap;
        }
        ssize_t n = read(fd, buf + len, cap - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            ret = -errno;
            goto err_close;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    ret = config_parse_buffer_flags(buf, len, path, c, flags, err, errlen);
    free(buf);
    return ret;

err_close:
    close(fd);
    free(buf);
err:
    if (err && errlen) {
        snprintf(err, errlen, "%s: %s", path ? path : "(null)",
                 ret == -EFBIG ? "file too large for a config (more than 64 MiB)" : strerror(-ret));
        one_line(err);
    }
    return ret;
}

void config_to_options(const struct zinf_config *c, struct zinf_options *o)
{
    memset(o, 0, sizeof(*o));
    o->nvme_path = c->nvme_paths.count ? c->nvme_paths.path[0] : NULL;
    o->nvme_paths_extra = c->nvme_paths.count > 1 ? c->nvme_paths_extra : NULL;
    o->device_bytes = (size_t)c->zinf.device_bytes;
    o->host_bytes = (size_t)c->zinf.host_bytes;
    o->block_size = (size_t)c->aio.block_size;
    o->queue_depth = c->aio.queue_depth;
    o->device_kind = c->zinf.device;
    o->cuda_device = c->zinf.cuda_device;
}

static void print_paths(FILE *f, const struct config_paths *ps)
{
    fputc('[', f);
    for (unsigned i = 0; i < ps->count; i++) {
        if (i)
            fputs(", ", f);
        json_print_string(f, ps->path[i]);
    }
    fputc(']', f);
}

static void print_bytes(FILE *f, uint64_t bytes, const char *zero_means)
{
    char h[32];

    fprintf(f, "%llu", (unsigned long long)bytes);
    if (bytes)
        fprintf(f, "  # %s", format_size(bytes, h, sizeof(h)));
    else if (zero_means)
        fprintf(f, "  # %s", zero_means);
}

/* The name of an enum value, or "?" for one no config file could have produced. */
static const char *enum_name(const char *const *names, int v)
{
    for (int i = 0; names[i]; i++)
        if (i == v)
            return names[i];
    return "?";
}

int config_print(const struct zinf_config *c, FILE *f)
{
    struct zinf_options o;

    for (size_t i = 0; i < ARRAY_SIZE(fields); i++) {
        const struct field *fd = &fields[i];
        const void *v = field_cptr(c, fd);
        bool dflt = !bit_get(c->given, fd);

        if (fd->ignored)
            continue; /* not a setting that acts: listed with the ignored keys below */
        if (sects[fd->sect].path)
            fprintf(f, "%s.%s = ", sects[fd->sect].path, fd->key);
        else
            fprintf(f, "%s = ", fd->key);
        if (bit_get(c->autos, fd)) {
            fputs("\"auto\"  # resolved by zinf train from its model and options\n", f);
            continue;
        }
        if (dflt && (fd->flags & FL_CMD)) {
            fputs("none  # not set: the command's own default\n", f);
            continue;
        }
        switch (fd->type) {
        case F_INT: fprintf(f, "%d", *(const int *)v); break;
        case F_UINT: fprintf(f, "%u", *(const unsigned *)v); break;
        case F_U64: fprintf(f, "%llu", (unsigned long long)*(const uint64_t *)v); break;
        case F_SIZE: fprintf(f, "%llu", (unsigned long long)*(const uint64_t *)v); break;
        case F_BOOL: fputs(*(const bool *)v ? "true" : "false", f); break;
        case F_ENUM: fprintf(f, "\"%s\"", enum_name(fd->names, *(const int *)v)); break;
        case F_PATHS: print_paths(f, v); break;
        case F_FLOAT: fprintf(f, "%.9g", *(const double *)v); break;
        case F_PAIR:
            fprintf(f, "[%.9g, %.9g]", ((const double *)v)[0], ((const double *)v)[1]);
            break;
        case F_STR: json_print_string(f, v); break;
        }
        fputs(dflt ? "  # default\n" : "\n", f);
    }

    config_to_options(c, &o);
    fputs("# engine options\n", f);
    fputs("engine.nvme_path = ", f);
    if (o.nvme_path)
        json_print_string(f, o.nvme_path);
    else
        fputs("none  # no NVMe tier", f);
    fputs("\nengine.nvme_paths_extra = [", f);
    for (unsigned i = 0; o.nvme_paths_extra && o.nvme_paths_extra[i]; i++) {
        if (i)
            fputs(", ", f);
        json_print_string(f, o.nvme_paths_extra[i]);
    }
    fputs("]\nengine.block_size = ", f);
    print_bytes(f, o.block_size, NULL);
    fprintf(f, "\nengine.queue_depth = %u\n", o.queue_depth);
    fputs("engine.device_bytes = ", f);
    print_bytes(f, o.device_bytes,
                "engine default: on a GPU its free memory less a reserve, emulated 1 GiB");
    fputs("\nengine.host_bytes = ", f);
    print_bytes(f, o.host_bytes, "engine default: 1 GiB");
    fprintf(f, "\nengine.device_kind = %s\n", enum_name(device_kinds, (int)o.device_kind));
    fprintf(f, "engine.cuda_device = %d\n", o.cuda_device);

    if (c->n_ignored) {
        fputs("# ignored by zinf (DeepSpeed keys zinf does not act on):\n", f);
        for (size_t i = 0; i < c->n_ignored; i++)
            fprintf(f, "#   %s\n", c->ignored[i]);
    }
    if (c->n_unknown) {
        fputs("# unknown keys (ignored):\n", f);
        for (size_t i = 0; i < c->n_unknown; i++)
            fprintf(f, "#   %s\n", c->unknown[i]);
    }
    fflush(f);
    return ferror(f) ? -EIO : 0;
}
