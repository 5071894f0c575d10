/*
 * config.h - the reader of DeepSpeed-style JSON configs: every setting zinf takes from a
 * DeepSpeed config (zero_optimization, offload_param, offload_optimizer, aio) with
 * DeepSpeed's meaning and defaults, plus a "zinf" section for what DeepSpeed has no key for.
 *
 * It is not a general DeepSpeed validator: the many DeepSpeed keys zinf does not use
 * (optimizer, fp16, train_batch_size, ...) are accepted without looking at their values.
 * Keys nobody knows are collected and warned about, never an error. Parsing stops at the
 * first bad value with one line naming its JSON path.
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
    bool pipeline_read;                /* false */
    bool pipeline_write;               /* false */
    bool fast_init;                    /* false */
};

struct zinf_config {
    struct {
        int stage;                                   /* 0..3, default 0 */
        uint64_t sub_group_size;                     /* 1e9 elements */
        struct config_offload_param offload_param;
        struct config_offload_optimizer offload_optimizer;
        uint64_t stage3_prefetch_bucket_size;        /* 5e7 elements */
        uint64_t stage3_max_live_parameters;         /* 1e9 elements */
        uint64_t stage3_max_reuse_distance;          /* 1e9 elements */
        uint64_t stage3_param_persistence_threshold; /* 1e5 elements */
    } zero;
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
        struct {                           /* zinf.train: `zinf train`'s model and run */
            int layers, dim, heads, seq, batch, steps; /* 0: the command's default */
            int precision; /* "auto" 0, "fp32" 1, "bf16" 2: as enum trainer_precision */
            int checkpoint_every; /* steps between checkpoints; 0: only at the end */
            uint64_t seed;                             /* given when bit set in `given` */
        } train;
    } zinf;

    /* Derived when a parse succeeds: the distinct NVMe directories in the order
     * zinf.nvme_paths, offload_param.nvme_path, offload_optimizer.nvme_path (an offload
     * section's paths count only when its device is "nvme"), and the NULL-terminated
     * tail of that list that config_to_options() hands out as nvme_paths_extra. */
    struct config_paths nvme_paths;
    const char *nvme_paths_extra[CONFIG_MAX_NVME_PATHS];

    /* Full JSON paths ("zero_optimization.offload_parm") of keys nobody knows, and of
     * DeepSpeed keys zinf knows but does not use. Owned. */
    char **unknown;
    size_t n_unknown;
    char **ignored;
    size_t n_ignored;

    uint64_t given; /* which settings the file set (bit per setting), for config_print */
};

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

/* Free what c owns and leave it holding the defaults; safe to call twice. */
void config_free(struct zinf_config *c);

/* The engine options c asks for; the strings in o point into c and live as long as it. */
void config_to_options(const struct zinf_config *c, struct zinf_options *o);

/* Print every effective setting, the derived engine options and the keys that were
 * ignored or unknown, one per line. Returns 0 or -EIO. */
int config_print(const struct zinf_config *c, FILE *f);

#endif
