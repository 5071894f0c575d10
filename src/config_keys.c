/*
 * config_keys.c - the keys a config may hold, as tables: every section (with the DeepSpeed
 * keys zinf reads but does not act on, each with why) and every setting (its section,
 * DeepSpeed's name and alias, its type, range and where struct zinf_config stores it), and
 * DeepSpeed's defaults for them. config.c's walk, config_auto.c and config_print.c all go
 * by these tables, so a setting added here is read, checked and printed at once.
 *
 * Not here: reading a file (config.c), resolving "auto" (config_auto.c) or writing the
 * settings out (config_print.c).
 */
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "config_int.h"

/* DeepSpeed keys zinf has no use for, each with why. Their values are not looked at: they
 * are DeepSpeed's business, and a config DeepSpeed accepts must be accepted here. */
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
    {"tensorboard", "monitoring: zinf train --log writes every step as a JSON line"},
    {"wandb", "monitoring: zinf train --log writes every step as a JSON line"},
    {"csv_monitor", "monitoring: zinf train --log writes every step as a JSON line"},
    {"comet", "monitoring: zinf train --log writes every step as a JSON line"},
    {"autotuning", "zinf tune measures the IO settings instead"},
    {"elasticity", "the ranks are fixed by zinf launch -n"},
    {"seq_parallel_communication_data_type", "a DeepSpeed feature zinf does not have"},
    {"data_types", "each tensor keeps its own type"},
    {"disable_allgather", "zinf's collectives size their own buffers"},
    {"sparse_attention", "a DeepSpeed feature zinf does not have"},
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
    {"var_freeze_step", "0/1 Adam's (ZeroOneAdam), which zinf train does not run"},
    {"var_update_scaler", "0/1 Adam's (ZeroOneAdam), which zinf train does not run"},
    {"local_step_scaler", "0/1 Adam's (ZeroOneAdam), which zinf train does not run"},
    {"local_step_clipper", "0/1 Adam's (ZeroOneAdam), which zinf train does not run"},
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

static const struct ignored_key pipe_ignored[] = {
    {"seed_layers", "every layout starts from the weights one rank would (seeded by name)"},
    {"activation_checkpoint_interval", "zinf train recomputes each block's activations in the backward already"},
    {"pipe_partitioned", "a stage sends its activations whole"},
    {"grad_partitioned", "a stage sends its gradients whole"},
    {NULL, NULL}};

static const struct ignored_key tp_ignored[] = {
    {"tp", "the tensor-parallel ranks are autotp_size"},
    {"tp_grain_size", "zinf train cuts by heads and hidden units"},
    {"injection_policy_tuple", "zinf train's model is its own GPT"},
    {"keep_module_on_host", "each rank keeps its slices where the tiers put them"},
    {"dtype", "each tensor keeps its own type"},
    {NULL, NULL}};

static const struct ignored_key moe_ignored[] = {
    {"enable_expert_tensor_parallelism", "zinf train cuts no expert across tensor-parallel ranks"},
    {"use_residual", "zinf train's MoE is DeepSpeed's plain MoE, not the residual MoE"},
    {"use_tutel", "zinf train runs its own gate and dispatch"},
    {NULL, NULL}};

const struct sectdef config_sects[S_COUNT] = {
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
    [S_PIPE] = {"pipeline", "pipeline", S_TOP, pipe_ignored},
    [S_TP] = {"tensor_parallel", "tensor_parallel", S_TOP, tp_ignored},
    [S_MOE] = {"moe", "moe", S_TOP, moe_ignored},
    [S_ACT] = {"activation_checkpointing", "activation_checkpointing", S_TOP, NULL},
};

static const char *const offload_devices[] = {"none", "cpu", "nvme", NULL};
const char *const config_device_kinds[] = {"auto", "cuda", "emulated", NULL};
static const char *const io_backends[] = {"auto", "io_uring", "threads", NULL};
static const char *const precisions[] = {"auto", "fp32", "bf16", "fp16", NULL};
/* As enum adamw_state_dtype. */
static const char *const state_dtypes[] = {"fp32", "bf16", "int8", NULL};
static const char *const warmup_types[] = {"log", "linear", NULL};
/* DeepSpeed's partition_method: "parameters" balances the stages' parameter counts; "best"
 * is its profiling search, here the same balance by parameters; "uniform" the same number
 * of blocks per stage. */
static const char *const pipe_partitions[] = {"parameters", "uniform", "best", NULL};
/* Where zinf train homes its activation checkpoints (zinf.train.activation_offload). */
static const char *const act_homes[] = {"auto", "device", "host", "nvme", NULL};

#define OFF(m) offsetof(struct zinf_config, m)
/* Table order is print order. A row leaves out flags and ignored when they are 0. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
const struct field config_fields[] = {
    /* It acts at any number of ranks: one rank holds its whole partition, and zinf launch -n N
     * partitions by it. */
    {S_ZERO, "stage", NULL, F_INT, OFF(zero.stage), 0, 3, 0, NULL},
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
    {S_ZINF, "device", NULL, F_ENUM, OFF(zinf.device), 0, 0, 0, config_device_kinds},
    {S_ZINF, "cuda_device", NULL, F_INT, OFF(zinf.cuda_device), 0, 0, 0, NULL},
    {S_ZINF, "sqpoll", NULL, F_BOOL, OFF(zinf.sqpoll), 0, 0, 0, NULL},
    {S_ZINF, "io_backend", NULL, F_ENUM, OFF(zinf.io_backend), 0, 0, 0, io_backends},
    {S_ZINF, "submit_batch", NULL, F_UINT, OFF(zinf.submit_batch), 0, 1024, 0, NULL},
    {S_ZINF, "staging_bytes", NULL, F_SIZE, OFF(zinf.staging_bytes), 0, 4 * GiB, 0, NULL},
    {S_ZINF, "huge_pages", NULL, F_BOOL, OFF(zinf.huge_pages), 0, 0, 0, NULL},
    {S_ZINF, "connect", NULL, F_PATHS, OFF(zinf.connect), 0, 0, 0, NULL},
    {S_ZINF, "job", NULL, F_STR, OFF(zinf.job), 0, 0, 0, NULL},
    /* zinf train --lora-rank through the daemon: the frozen base read, read-only, from this
     * job of the daemon's (one copy for every job that names it) */
    {S_ZINF, "base_job", NULL, F_STR, OFF(zinf.base_job), 0, 0, 0, NULL},
    {S_ZINF, "comm_timeout", NULL, F_UINT, OFF(zinf.comm_timeout), 1, 86400, 0, NULL},
    /* zinf train's CPU ranks: the emulated device arena in the ranks' shared pool, so that
     * their collectives copy once (false: through the staging areas, twice). */
    {S_ZINF, "comm_pool", NULL, F_BOOL, OFF(zinf.comm_pool), 0, 0, 0, NULL},
    {S_ZINF, "optimizer_state_dtype", NULL, F_ENUM, OFF(zinf.optimizer_state_dtype), 0, 0, 0,
     state_dtypes},
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
    {S_TOP, "communication_data_type", NULL, F_STR, OFF(train.comm_dtype), 0, 0, 0, NULL},
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
    {S_OPT_PARAMS, "freeze_step", NULL, F_INT, OFF(train.optimizer.freeze_step), 1, 0, 0, NULL},
    {S_OPT_PARAMS, "cuda_aware", NULL, F_BOOL, OFF(train.optimizer.cuda_aware), 0, 0, 0, NULL},
    {S_OPT_PARAMS, "comm_backend_name", NULL, F_STR, OFF(train.optimizer.comm_backend_name), 0, 0,
     0, NULL},
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
    /* Pipeline parallelism: zinf launch -n N starts N / stages copies of a pipeline of
     * `stages` ranks, each holding a contiguous run of the blocks. */
    {S_PIPE, "stages", NULL, F_INT, OFF(pipeline.stages), 1, 64, 0, NULL},
    {S_PIPE, "partition", "partition_method", F_ENUM, OFF(pipeline.partition), 0, 0, 0,
     pipe_partitions},
    /* zinf's own: where each stage after the first begins, as block numbers ("3,5": stages
     * of blocks 0-2, 3-4, 5-); given, it replaces pipeline.partition. */
    {S_TRAIN, "pipeline_cut", NULL, F_STR, OFF(zinf.train.pipeline_cut), 0, 0, 0, NULL},
    /* Tensor parallelism (DeepSpeed's AutoTP size): the heads and hidden units of every
     * block, and the vocabulary, cut over this many ranks of each stage. */
    {S_TP, "autotp_size", NULL, F_INT, OFF(tensor_parallel.autotp_size), 1, 64, 0, NULL},
    /* Sequence parallelism (DeepSpeed-Ulysses): each sequence's positions cut over this
     * many ranks, the attention's heads exchanged by all-to-all. */
    {S_TOP, "sequence_parallel_size", NULL, F_INT, OFF(sequence_parallel_size), 1, 64, 0, NULL},
    /* Mixture of experts (DeepSpeed's deepspeed.moe.layer.MoE arguments): every moe_every-th
     * block's MLP, from block 0, is num_experts experts behind a top_k gate (moe.h). */
    {S_MOE, "num_experts", NULL, F_INT, OFF(moe.num_experts), 0, 4096, 0, NULL},
    {S_MOE, "ep_size", NULL, F_INT, OFF(moe.ep_size), 1, 4096, 0, NULL},
    {S_MOE, "top_k", "k", F_INT, OFF(moe.top_k), 1, 2, 0, NULL},
    {S_MOE, "capacity_factor", NULL, F_FLOAT, OFF(moe.capacity_factor), 0, 0, 0, NULL},
    {S_MOE, "eval_capacity_factor", NULL, F_FLOAT, OFF(moe.eval_capacity_factor), 0, 0, 0, NULL,
     0, "the held-out loss is taken with capacity_factor"},
    {S_MOE, "min_capacity", NULL, F_INT, OFF(moe.min_capacity), 0, 0, 0, NULL},
    {S_MOE, "drop_tokens", NULL, F_BOOL, OFF(moe.drop_tokens), 0, 0, 0, NULL},
    {S_MOE, "use_rts", NULL, F_BOOL, OFF(moe.use_rts), 0, 0, 0, NULL},
    {S_MOE, "noisy_gate_policy", NULL, F_STR, OFF(moe.noisy_gate_policy), 0, 0, 0, NULL,
     FL_NULL},
    {S_MOE, "loss_coef", NULL, F_FLOAT, OFF(moe.loss_coef), 0, 0, 0, NULL},
    {S_MOE, "moe_every", NULL, F_INT, OFF(moe.moe_every), 1, 1024, 0, NULL},
    /* Activation checkpoints (DeepSpeed's activation_checkpointing): zinf train keeps every
     * block's input between the forward and the backward, which recomputes the block, always.
     * cpu_checkpointing homes them off the device (true: as zinf.train.activation_offload
     * "auto"; false: "device"); where the two disagree, zinf train refuses. */
    {S_ACT, "cpu_checkpointing", NULL, F_BOOL, OFF(activation_checkpointing.cpu_checkpointing),
     0, 0, 0, NULL, FL_CMD},
    {S_ACT, "partition_activations", NULL, F_BOOL,
     OFF(activation_checkpointing.partition_activations), 0, 0, 0, NULL, 0,
     "each rank keeps its own batch's checkpoints (a sequence-parallel rank its positions'); "
     "tensor-parallel ranks each keep them whole"},
    {S_ACT, "contiguous_memory_optimization", NULL, F_BOOL,
     OFF(activation_checkpointing.contiguous_memory_optimization), 0, 0, 0, NULL, 0,
     "each checkpoint is one contiguous zinf tensor already"},
    {S_ACT, "number_checkpoints", NULL, F_INT, OFF(activation_checkpointing.number_checkpoints),
     0, 0, 0, NULL, FL_NULL,
     "zinf train keeps one checkpoint per block, and the last block's output"},
    {S_ACT, "synchronize_checkpoint_boundary", NULL, F_BOOL,
     OFF(activation_checkpointing.synchronize_checkpoint_boundary), 0, 0, 0, NULL, 0,
     "zinf train waits for each block's kernels before its checkpoints are released always"},
    {S_ACT, "profile", NULL, F_BOOL, OFF(activation_checkpointing.profile), 0, 0, 0, NULL, 0,
     "profiling: zinf train's step lines, --log and --trace give the times"},
    /* zinf's own: where the checkpoints are homed. "auto": the host tier, or NVMe (the
     * engine's swap directory) where the host budget cannot hold them beside the rest;
     * "device", "host", "nvme": there always. */
    {S_TRAIN, "activation_offload", NULL, F_ENUM, OFF(zinf.train.activation_offload), 0, 0, 0,
     act_homes},
    /* DeepSpeed's deprecated ZeRO-Offload switches, last: finish() maps them. */
    {S_ZERO, "cpu_offload", NULL, F_BOOL, OFF(zero.cpu_offload), 0, 0, 0, NULL},
    {S_ZERO, "cpu_offload_param", "cpu_offload_params", F_BOOL, OFF(zero.cpu_offload_param), 0, 0,
     0, NULL},
    {S_ZERO, "cpu_offload_use_pin_memory", NULL, F_BOOL, OFF(zero.cpu_offload_use_pin_memory), 0,
     0, 0, NULL, 0,
     "DeepSpeed reads it no more: pin_memory in offload_param or offload_optimizer pins"},
};
#pragma GCC diagnostic pop
_Static_assert(ARRAY_SIZE(config_fields) <= 64 * ARRAY_SIZE(((struct zinf_config *)0)->given), "struct zinf_config.given has one bit per field");
const size_t config_nfields = ARRAY_SIZE(config_fields);

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
    c->pipeline.stages = 1;
    c->tensor_parallel.autotp_size = 1;
    c->sequence_parallel_size = 1;
    c->moe.ep_size = 1;
    c->moe.top_k = 1;
    c->moe.capacity_factor = 1.0;
    c->moe.eval_capacity_factor = 1.0;
    c->moe.min_capacity = 4;
    c->moe.drop_tokens = true;
    c->moe.loss_coef = 0.01;
    c->moe.moe_every = 1;
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
    c->train.optimizer.freeze_step = 100000; /* OneBitAdam's */
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

const struct field *config_field_by_path(const char *json_path)
{
    for (size_t i = 0; i < config_nfields; i++) {
        const char *sp = config_sects[config_fields[i].sect].path;
        size_t n = sp ? strlen(sp) : 0;
        if (sp && (strncmp(json_path, sp, n) || json_path[n] != '.'))
            continue;
        if (!strcmp(json_path + (sp ? n + 1 : 0), config_fields[i].key))
            return &config_fields[i];
    }
    return NULL;
}

bool config_given(const struct zinf_config *c, const char *json_path)
{
    const struct field *f = config_field_by_path(json_path);
    return f && config_bit_get(c->given, f);
}

bool config_is_auto(const struct zinf_config *c, const char *json_path)
{
    const struct field *f = config_field_by_path(json_path);
    return f && config_bit_get(c->autos, f);
}

/* A likely meant name for an unknown key: the same name in another section (written as a
 * full path), else a close spelling of a name this section knows. NULL when none. */
const char *config_suggest(int s, const char *key, char *buf, size_t n)
{
    const char *best = NULL;
    unsigned best_d = 3;

    for (size_t i = 0; i < config_nfields; i++) {
        const struct field *f = &config_fields[i];
        if (f->sect != s && (!strcmp(f->key, key) || (f->alias && !strcmp(f->alias, key)))) {
            snprintf(buf, n, "%s.%s", config_sects[f->sect].path, f->key);
            return buf;
        }
    }
    for (int i = 1; i < S_COUNT; i++) {
        if (config_sects[i].parent != s && !strcmp(config_sects[i].key, key)) {
            snprintf(buf, n, "%s", config_sects[i].path);
            return buf;
        }
    }
    if (strlen(key) < 4)
        return NULL;
    for (size_t i = 0; i < config_nfields; i++) {
        if (config_fields[i].sect != s)
            continue;
        unsigned d = edit_distance(key, config_fields[i].key, 3);
        if (d < best_d) {
            best_d = d;
            best = config_fields[i].key;
        }
    }
    for (int i = 1; i < S_COUNT; i++) {
        if (config_sects[i].parent == s) {
            unsigned d = edit_distance(key, config_sects[i].key, 3);
            if (d < best_d) {
                best_d = d;
                best = config_sects[i].key;
            }
        }
    }
    if (!best)
        return NULL;
    snprintf(buf, n, "%s", best);
    return buf;
}
