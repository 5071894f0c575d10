/*
 * config.h - the reader of DeepSpeed-style JSON configs: every setting zinf takes from a
 * DeepSpeed config (zero_optimization, offload_param, offload_optimizer, aio) with
 * DeepSpeed's meaning and defaults, plus a "zinf" section for what DeepSpeed has no key for.
 *
 * The training keys (train_micro_batch_size_per_gpu, gradient_accumulation_steps,
 * gradient_clipping, optimizer, scheduler, fp16, bf16, steps_per_print) are read too:
 * `zinf train` honours them. Every key is either a setting that acts or is named as
 * ignored (with why) in c->ignored: DeepSpeed keys zinf has no use for are accepted without
 * looking at their values. "auto", as Hugging Face's Trainer writes it, is taken where its
 * DeepSpeed integration takes it; config_resolve_auto() resolves it. Keys nobody knows are
 * collected and warned about, never an error. Parsing stops at the first bad value with
 * one line naming its JSON path.
 */
#ifndef ZINF_CONFIG_H
#define ZINF_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "zinf.h"

/* At most this many distinct NVMe directories in one config, over all sections. */
#define CONFIG_MAX_NVME_PATHS 16

enum config_offload_device { CONFIG_OFFLOAD_NONE, CONFIG_OFFLOAD_CPU, CONFIG_OFFLOAD_NVME };
enum config_io_backend { CONFIG_IO_AUTO, CONFIG_IO_URING, CONFIG_IO_THREADS };

/* A list of owned directory strings, in the order given. */
struct config_paths {
    char *path[CONFIG_MAX_NVME_PATHS];
    unsigned count;
};

/* zero_optimization.offload_param */
struct config_offload_param {
    enum config_offload_device device; /* "none" */
    struct config_paths nvme_path;     /* string or list; required when device is nvme */
    bool pin_memory;                   /* false */
    uint64_t buffer_count;             /* 5 */
    uint64_t buffer_size;              /* 1e8 elements (not bytes) per buffer */
    uint64_t max_in_cpu;               /* 1e9 elements kept in CPU memory */
};

/* zero_optimization.offload_optimizer */
struct config_offload_optimizer {
    enum config_offload_device device; /* "none" */
    struct config_paths nvme_path;     /* string or list; required when device is nvme */
    bool pin_memory;                   /* false */
    uint64_t buffer_count;             /* 4 */
    bool pipeline_read;                /* true (DeepSpeed: false): the trainer's optimizer
                                          fetches the next tensor while it updates one */
    bool pipeline_write;               /* true (DeepSpeed: false): the engine writes a dirty
                                          copy back at release when the learned step says it
                                          is evicted before its next use (write-behind) */
    bool fast_init;                    /* false */
};

/* DeepSpeed's training keys, as `zinf train` honours them. 0 (or "") where unset: the
 * command's own defaults apply then. */
struct config_train_keys {
    uint64_t train_batch_size;     /* micro batch x accumulation steps (x ranks: 1) */
    int micro_batch;               /* train_micro_batch_size_per_gpu */
    int grad_accum;                /* gradient_accumulation_steps */
    double grad_clip;              /* gradient_clipping (0: off) */
    int steps_per_print;           /* print a step line every this many steps */
    char comm_dtype[16];           /* communication_data_type: "fp32", "fp16", "bf16" or "" */
    struct {
        char type[32];             /* "Adam" or "AdamW" (any case); others are refused by
                                      zinf train */
        double lr, betas[2], eps, weight_decay;
        bool adam_w_mode;          /* true: decoupled decay (AdamW); false: L2 in the grad */
        bool bias_correction;      /* true (DeepSpeed's default) */
        double max_coeff, min_coeff; /* Lamb's trust-ratio bounds: 10, 0.01 */
        bool eps_inside_sqrt;      /* Lamb's: false */
        int freeze_step;           /* OneBitAdam's: plain Adam steps before compression
                                      (DeepSpeed's default 100000) */
        bool cuda_aware;           /* OneBitAdam's (MPI's): accepted, moves nothing */
        char comm_backend_name[16]; /* OneBitAdam's: "nccl" (default) or "mpi" */
    } optimizer;
    struct {
        char type[32];             /* "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                      "LRRangeTest" */
        double warmup_min_lr, warmup_max_lr, warmup_min_ratio, cos_min_ratio;
        int warmup_num_steps, total_num_steps;
        int warmup_type;           /* 0 "log", 1 "linear" */
        /* LRRangeTest: lr = min_lr (1 + step_rate x interval), interval the iterations
         * over step_size (floored with staircase); DeepSpeed's defaults 1e-3, 2000, 1.0 */
        double lr_range_test_min_lr, lr_range_test_step_rate;
        int lr_range_test_step_size;
        bool lr_range_test_staircase;
        /* OneCycle, DeepSpeed's names and defaults (cycle_first_step_size 2000,
         * cycle_momentum true, cycle_min_mom 0.8, cycle_max_mom 0.9; cycle_min_lr and
         * cycle_max_lr have none) */
        double cycle_min_lr, cycle_max_lr, decay_lr_rate;
        int cycle_first_step_size, cycle_second_step_size;
        int cycle_first_stair_count, cycle_second_stair_count, decay_step_size;
        bool cycle_momentum;
        double cycle_min_mom, cycle_max_mom, decay_mom_rate;
    } scheduler;
    struct {
        bool enabled;
        double loss_scale;         /* 0: dynamic */
        int initial_scale_power, loss_scale_window, hysteresis;
        bool consecutive_hysteresis;
        double min_loss_scale;
    } fp16;
    struct {
        bool enabled;
    } bf16;
};

struct zinf_config {
    struct config_train_keys train;
    struct {
        int stage;                                   /* 0..3, default 0 */
        uint64_t sub_group_size;                     /* 1e9 elements */
        struct config_offload_param offload_param;
        struct config_offload_optimizer offload_optimizer;
        uint64_t stage3_prefetch_bucket_size;        /* 5e7 elements */
        uint64_t stage3_max_live_parameters;         /* 1e9 elements */
        uint64_t stage3_max_reuse_distance;          /* 1e9 elements */
        uint64_t stage3_param_persistence_threshold; /* 1e5 elements */
        bool overlap_comm;                           /* not given: true at stage 3 only */
        uint64_t reduce_bucket_size;                 /* 5e8 elements; 0 allowed */
        /* DeepSpeed's deprecated forms, mapped as it maps them: cpu_offload true is
         * offload_optimizer.device "cpu", cpu_offload_param (older: cpu_offload_params)
         * true is offload_param.device "cpu"; with the section they replace: refused. */
        bool cpu_offload, cpu_offload_param, cpu_offload_use_pin_memory;
    } zero;
    struct {
        int autotp_size; /* tensor-parallel ranks; 1 (none) */
    } tensor_parallel;
    int sequence_parallel_size; /* Ulysses sequence-parallel ranks; 1 (none) */
    struct {
        int stages;    /* pipeline stages; 1 (none) */
        int partition; /* "parameters" 0, "uniform" 1, "best" 2 (as "parameters") */
    } pipeline;
    /* Mixture of experts in zinf train (DeepSpeed's MoE layer arguments; moe.h). */
    struct {
        int num_experts;             /* 0: no MoE (the default) */
        int ep_size;                 /* expert-parallel ranks; 1 */
        int top_k;                   /* 1 or 2; 1 */
        double capacity_factor;      /* > 0; 1.0 */
        double eval_capacity_factor; /* read, named as ignored */
        int min_capacity;            /* 4 */
        bool drop_tokens;            /* true */
        bool use_rts;                /* false; true is refused (not deterministic) */
        char noisy_gate_policy[32];  /* "" (null); any policy is refused */
        double loss_coef;            /* the aux loss's coefficient; 0.01 */
        int moe_every;               /* zinf's: every how many blocks, from block 0; 1 */
    } moe;
    /* DeepSpeed's activation checkpoints: zinf train keeps every block's input (and recomputes
     * the block in the backward) always; where those inputs live is cpu_checkpointing's and
     * zinf.train.activation_offload's. The rest is read and named as ignored. */
    struct {
        bool cpu_checkpointing;    /* false (given: true "auto", false "device" homes) */
        bool partition_activations, contiguous_memory_optimization;
        bool synchronize_checkpoint_boundary, profile;
        int number_checkpoints;    /* 0 (null) */
    } activation_checkpointing;
    struct {
        uint64_t block_size;           /* bytes; 1 MiB; multiple of 4096, at most 64 MiB */
        unsigned queue_depth;          /* 8; 1..1024 */
        unsigned intra_op_parallelism; /* 1; alias thread_count: io_uring rings, each with
                                        * its completion thread (at most 8 are used) */
        bool single_submit;            /* false */
        bool overlap_events;           /* true */
        bool use_gds;                  /* false */
    } aio;
    struct {
        uint64_t device_bytes;            /* 0: the engine's default */
        uint64_t host_bytes;              /* 0: the engine's default */
        struct config_paths nvme_paths;   /* one directory per drive */
        enum zinf_device_kind device;     /* "auto" */
        int cuda_device;                  /* 0 */
        bool sqpoll;                      /* false */
        enum config_io_backend io_backend; /* "auto" */
        unsigned submit_batch;   /* refill the IO queue once this many slots are free; 0 */
        uint64_t staging_bytes;  /* the staging ring (NVMe <-> device); 0: from offload_param
                                  * buffers, or 2 x queue_depth blocks */
        bool huge_pages;         /* transparent huge pages for the host arena; true */
        struct config_paths connect; /* zinf train through the daemon on this socket; none */
        char job[32];                /* ... as this job; "" (zinf train's default) */
        char base_job[32]; /* ... its LoRA base read-only from this job (shared); "": none */
        unsigned comm_timeout; /* seconds each barrier and collective across ranks waits for
                                  the others; 1800 (COMM_DEFAULT_OP_TIMEOUT_MS) */
        bool comm_pool; /* CPU ranks: the device tier's arena in the communicator's pool (one
                           copy a collective); true */
        int optimizer_state_dtype; /* Adam's m and v: "fp32" 0, "bf16" 1, "int8" 2 (8-bit
                                      blockwise); "fp32" */
        struct {                           /* zinf.train: `zinf train`'s model and run */
            int layers, dim, heads, seq, batch, steps; /* 0: the command's default */
            int precision; /* "auto" 0, "fp32" 1, "bf16" 2: as enum trainer_precision */
            int checkpoint_every; /* steps between checkpoints; 0: only at the end */
            bool checkpoint_start; /* a new run's step 0 is saved before step 1; true */
            bool update_in_forward; /* one rank offloaded to NVMe: each tensor's update runs
                                       just before the next forward's first use; true */
            uint64_t seed;                             /* given when bit set in `given` */
            char pipeline_cut[32]; /* "3,5": the first block of each stage after the first */
            /* Where the activation checkpoints are homed: "auto" 0 (the host tier, on NVMe
             * where the host budget cannot hold them), "device" 1, "host" 2, "nvme" 3 */
            int activation_offload;
        } train;
        struct config_serve {           /* zinf.serve: `zinf serve`'s limits */
            unsigned jobs_per_uid;        /* jobs a uid may have open; 4 */
            unsigned max_jobs;            /* jobs open in all; 64 */
            unsigned sessions_per_uid;    /* client processes attached, per uid; 64 */
            unsigned connections_per_uid; /* open connections per uid; 256 */
            unsigned max_connections;     /* open connections in all; 1024 */
            /* of max_connections, kept for root and the daemon's uid: others are refused
             * once fewer remain; 16 */
            unsigned reserved_connections;
            unsigned hello_timeout;   /* seconds a new connection has to send HELLO; 10 */
            unsigned idle_job_close;  /* seconds without a session before a job is closed
                                         (flushed, its memory given back); 600; 0 never */
            uint64_t write_stage_bytes; /* bytes of zinf_write a session may have staged
                                           in the daemon at once; 1 GiB */
            unsigned stages_per_session;  /* stages a session may have open at once; 64 */
            unsigned tickets_per_session; /* zinf_fetch_async tickets a session may have
                                             unwaited; 16384 */
            unsigned saved_jobs_per_uid;  /* job folders a uid may have under the swap
                                             directory, open or saved; 256 */
            uint64_t swap_bytes_per_uid;  /* bytes of tensors homed on NVMe a uid may have
                                             registered in its open jobs; 1 TiB */
        } serve;
    } zinf;

    /* Derived when a parse succeeds: the distinct NVMe directories in the order
     * zinf.nvme_paths, offload_param.nvme_path, offload_optimizer.nvme_path (an offload
     * section's paths count only when its device is "nvme"), and the NULL-terminated
     * tail of that list that config_to_options() hands out as nvme_paths_extra. */
    struct config_paths nvme_paths;
    const char *nvme_paths_extra[CONFIG_MAX_NVME_PATHS];

    /* Not read from a file: memory its user lends the emulated device tier as its arena, of
     * device_arena_bytes, at least zinf.device_bytes rounded up to 4 KiB (the trainer's CPU
     * ranks lend their communicator's pool, so that collectives on device buffers copy
     * once); NULL: the tier maps its own. The engine never unmaps it. */
    void *device_arena;
    size_t device_arena_bytes;

    /* Full JSON paths ("zero_optimization.offload_parm") of keys nobody knows, and of
     * DeepSpeed keys zinf knows but does not use. Owned. */
    char **unknown;
    size_t n_unknown;
    char **ignored;
    size_t n_ignored;

    uint64_t given[3]; /* which settings the file set (bit per setting), for config_print */
    uint64_t autos[3]; /* ... and which of them it set to "auto" */
};

/* Settings a file may set to "auto" (as Hugging Face's Trainer writes them), resolved
 * from what only the caller knows. */
struct config_auto_inputs {
    int hidden_size;          /* the model's width: bucket sizes and thresholds */
    int micro_batch, grad_accum, steps;
    double lr, weight_decay, grad_clip;
    int bf16;                 /* bf16.enabled: 1 or 0; -1: leave it "auto" (the caller
                                 decides where it runs) */
    int fp16;                 /* fp16.enabled: 1 or 0 */
};

/* Replace every "auto" in c by its value from in, as the Hugging Face integration of
 * DeepSpeed does, and say what each became: one "json.path = value" line per setting into
 * out (at most outlen bytes; "" when nothing was auto). */
void config_resolve_auto(struct zinf_config *c, const struct config_auto_inputs *in, char *out,
                         size_t outlen);
/* Was this setting (its JSON path, e.g. "optimizer.params.lr") given in the file, or set to
 * "auto"? */
bool config_given(const struct zinf_config *c, const char *json_path);
bool config_is_auto(const struct zinf_config *c, const char *json_path);

/* Fill c with DeepSpeed's defaults; c owns nothing afterwards. */
void config_defaults(struct zinf_config *c);

/*
 * Parse a JSON config into c, which need not be initialised (whatever it held is not
 * freed). On error returns -EINVAL (or the -errno of reading the file), writes one line
 * into err (when err is not NULL): "json.path: what is wrong", "NAME:LINE:COL: syntax
 * error" or "FILE: strerror", and leaves c holding the defaults. Unknown keys are logged
 * as warnings and listed in c->unknown. Free c with config_free() in every case.
 */
int config_parse_file(const char *path, struct zinf_config *c, char *err, size_t errlen);
int config_parse_buffer(const char *buf, size_t len, const char *name, struct zinf_config *c,
                        char *err, size_t errlen);
/* The same with flags: CONFIG_PARSE_QUIET lists unknown keys without logging them, for a
 * second read of a file whose reader has warned already. */
#define CONFIG_PARSE_QUIET (1u << 0)
int config_parse_file_flags(const char *path, struct zinf_config *c, unsigned flags, char *err,
                            size_t errlen);
int config_parse_buffer_flags(const char *buf, size_t len, const char *name,
                              struct zinf_config *c, unsigned flags, char *err, size_t errlen);

/* Free what c owns and leave it holding the defaults; safe to call twice. */
void config_free(struct zinf_config *c);

/* The engine options c asks for; the strings in o point into c and live as long as it. */
void config_to_options(const struct zinf_config *c, struct zinf_options *o);

/* Print every effective setting, the derived engine options and the keys that were
 * ignored or unknown, one per line. Returns 0 or -EIO. */
int config_print(const struct zinf_config *c, FILE *f);
/* The same without the keys ignored or unknown: the settings and the engine options. */
int config_print_settings(const struct zinf_config *c, FILE *f);

#endif
