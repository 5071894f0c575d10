/*
 * cmd_train.h - what the files of `zinf train` share, for them alone: the command line as
 * cmd_train_opts.c makes it, and what cmd_train_report.c prints and logs for the run that
 * cmd_train.c drives.
 */
#ifndef ZINF_TOOLS_CMD_TRAIN_H
#define ZINF_TOOLS_CMD_TRAIN_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/resource.h>

#include "train/train_config.h"
#include "train/trainer.h"
#include "train/weights.h"

/* ---- the command line (cmd_train_opts.c) ------------------------------------------------ */

/* zinf train's options and the environment zinf launch sets, with the config applied. */
struct train_args {
    struct trainer_opts o;
    struct train_config_applied ds; /* what the config's keys did */
    const char *log_path, *trace_path, *export_path;
    const char *export_hf, *init_path; /* --export-hf DIR, --init FILE */
    const char *export_lora;           /* --export-lora DIR: a LoRA run's adapters */
    long eval_every, eval_batches, sample_every, sample_bytes;
    long ckpt_every;     /* --checkpoint-every, else zinf.train.checkpoint_every */
    long print_lr;       /* --print-lr N: with --dry-run, the first N steps' learning rates */
    int steps_per_print; /* the config's steps_per_print, 1 where it has none */
    bool dry_run;        /* --dry-run: decide what would run, run nothing */
    bool nvme_offload;   /* the config offloads the parameters or the optimizer to NVMe */
};

/* ---- a LoRA run's exports (cmd_train_lora.c) -------------------------------------------- */

/* The weights of tensor d (zinf's layout, fp32 in w) merged with the run's adapter where d
 * is a targeted linear's: w += (alpha / r) B A (0; -errno where an adapter cannot be read). */
int cmd_train_lora_merge(struct trainer *t, const struct trainer_opts *o,
                         const struct gpt_tensor_desc *d, float *w);
/* --export-lora: the adapters as PEFT saves them, dir/adapter_model.safetensors and
 * dir/adapter_config.json (base: base_model_name_or_path, may be NULL); 0 or -errno, said
 * on stderr. */
int cmd_train_export_lora(struct trainer *t, const struct trainer_opts *o, int step,
                          const char *dir, const char *base);

/* argv into a, the config read and applied: -1 to go on, else the exit status (0 after
 * --help, 2 for bad input, said on stderr with the usage where it helps). */
int cmd_train_parse(int argc, char **argv, struct train_args *a);

/* ---- what is printed and logged (cmd_train_report.c) ------------------------------------ */

/* ,"key":v in the log, written so that it reads back as the same value: %.9g for a float,
 * %.17g for a double; null where it is not finite (JSON has no NaN or infinity). */
void cmd_train_json_num(FILE *f, const char *key, double v, bool is_float);
/* Each line of an error text (weights_open's "PATH: what" lines), said after prefix. */
void cmd_train_say_lines(const char *prefix, const char *text);
/* What a failure leaves saved: the last checkpoint, or nothing before the first. */
void cmd_train_say_kept(const struct trainer_summary *sum, const char *when);

/* A step's line of the log, held until its digest is known: with the update deferred to the
 * next forward, the next step (or whatever finishes the update first) gives it. */
struct held_line {
    char *line; /* up to the digest; NULL: none held */
    int step;
};
void cmd_train_held_put(FILE *log, struct held_line *h, bool have, uint64_t digest);
/* The held line, with the digest the trainer has if it is that step's (its update finished),
 * else none (it failed, or the state is torn). */
void cmd_train_held_put_summary(struct trainer *t, FILE *log, struct held_line *h);

/* The CPU seconds this process's threads have used, summed by thread name (the engine
 * names its own: zinf-copy, zinf-reap, zinf-io, zinf-comm, zinf-trace), from
 * /proc/self/task. A thread that ended takes its time with it: per step, the deltas of the
 * threads that live on. */
#define CPU_NAMES 8
struct cpu_names {
    int n;
    char name[CPU_NAMES][16];
    double s[CPU_NAMES];
};
void cmd_train_cpu_by_thread(struct cpu_names *c);

/* --dry-run: what would run (the model, the run, what "auto" became, the keys ignored), the
 * first print_lr steps' learning rates, and what --init (init, from init_path; may be
 * NULL) would load. */
void cmd_train_print_dry_run(const struct trainer_opts *o, const struct train_config_applied *ds,
                             long print_lr, const struct weights_file *init,
                             const char *init_path);
/* The start of a run: the model, the budgets and how they were derived, and a warning where
 * an NVMe offload will see nothing but the checkpoints. */
void cmd_train_print_start(const struct trainer_opts *o, const struct trainer_summary *sum,
                           bool nvme_offload);
/* The compute, the effective settings (also the first line of the log) and the steps'
 * table header. */
void cmd_train_print_head(const struct trainer_opts *o, const struct train_config_applied *ds,
                          const struct trainer_summary *sum, long ckpt_every, int every,
                          FILE *log);
/* A step's line of the table (sum: the run's, for its precision). */
void cmd_train_print_step(const struct trainer_step_stats *st, double eta,
                          const struct trainer_summary *sum);
/* A step's line of the log, up to its digest, into ln: the step's stats, its CPU time (ru0
 * and ru1 around it) and by thread (c0 and c1 around it). */
void cmd_train_log_step(FILE *ln, const struct trainer_step_stats *st, double eta,
                        const struct rusage *ru0, const struct rusage *ru1,
                        const struct cpu_names *c0, const struct cpu_names *c1);
/* The run as it ended, on stdout and as the log's last line (log may be NULL): ran steps in
 * ran_seconds, blocked_s[5] (in fetch; of it nvme, copy, room, pin), whether a signal
 * stopped it, and the exit status so far. */
void cmd_train_print_summary(const struct trainer_opts *o, const struct trainer_summary *sum,
                             int ran, double ran_seconds, const double blocked_s[5],
                             bool interrupted, int status, FILE *log);

#endif
