/*
 * cmd_train.c - `zinf train`: train a byte-level GPT-style model whose state lives in zinf.
 *
 * The effective settings first (the options over DeepSpeed's keys over the zinf.train
 * section, "auto" resolved, the keys zinf does not act on named), then one line per step
 * (loss, tokens/s, NVMe traffic, time blocked on fetch, ETA), one per checkpoint (its time
 * and the bytes it wrote), the held-out loss and sampled text when asked, a summary with
 * the run's time and each tier's peak next to its budget; the same as JSON lines with --log. The
 * state is checkpointed at the start, every --checkpoint-every steps and at the end, so that a
 * crash loses at most the steps since the last checkpoint. SIGINT/SIGTERM (and SIGHUP, and
 * SIGPIPE: whoever read the output is gone) finish the step, flush, and exit with 128 + the
 * signal (the JSON summary says "interrupted": true): --resume continues exactly
 * from there. --init starts from the weights of a safetensors file or a Hugging Face folder
 * (checked whole before the run opens), --export and --export-hf write them out at the end
 * (src/train/weights.h).
 */
#include <errno.h>
#include <jansson.h>
#include <fcntl.h>
#include <dirent.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "cmd.h"
#include "common.h"
#include "config.h"
#include "engine/engine.h"
#include "progress.h"
#include "trace.h"
#include "train/gpt.h"
#include "comm/comm.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "train/weights.h"
#include "zinf.h"

/* Options of this file alone, past train_config.h's (which may grow). */
enum {
    O_LOG = 512,
    O_RESUME,
    O_OVERWRITE,
    O_CKPT,
    O_EVAL,
    O_EVAL_BATCHES,
    O_SAMPLE,
    O_SAMPLE_BYTES,
    O_CONNECT,
    O_JOB,
    O_TRACE,
    O_EXPORT,
    O_STRICT,
    O_DRY_RUN,
    O_PRINT_LR,
    O_INIT,
    O_EXPORT_HF
};

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
    stop_requested = sig;
}

/* A write to a pipe nobody reads any more (zinf launch was killed, a `| head` has its
 * lines) would end the run there, losing every step since the last checkpoint: it asks the
 * loop to stop instead, as SIGTERM does, unless a signal asked first. What is printed from
 * then on goes nowhere. */
static void on_sigpipe(int sig)
{
    if (!stop_requested) stop_requested = sig;
}

static const char *stop_name(int sig)
{
    return sig == SIGINT    ? "SIGINT"
           : sig == SIGHUP  ? "SIGHUP"
           : sig == SIGPIPE ? "SIGPIPE"
                            : "SIGTERM";
}

static void stop_trace(void)
{
    trace_stop();
}

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: zinf train --config FILE --data FILE [options]\n"
        "  --config FILE     DeepSpeed-style JSON: offload devices, nvme_path, aio, and the\n"
        "                    zinf section's device_bytes / host_bytes budgets\n"
        "  --data FILE       training text; its bytes are the tokens (vocabulary 256)\n"
        "  --layers N        transformer blocks (default 4)\n"
        "  --dim N           model width (default 128)\n"
        "  --heads N         attention heads, dividing --dim (default 4)\n"
        "  --seq N           tokens per sequence (default 64)\n"
        "  --batch N         sequences per step (default 4)\n"
        "  --steps N         total steps (default 100; a resumed run continues up to N)\n"
        "  --lr X            the optimizer's learning rate, whichever optimizer the config\n"
        "                    names (default 1e-3)\n"
        "  --weight-decay X  decoupled weight decay of the matrices (default 0)\n"
        "  --clip X          global gradient-norm clip, 0 = off (default 1)\n"
        "  --accumulate N    micro-batches of --batch per optimizer step (default 1)\n"
        "  --seed N          initialisation and batch order (default 1337)\n"
        "  --log FILE.jsonl  also write every step and the summary as JSON lines\n"
        "  --export FILE.safetensors\n"
        "                    at the end, write the fp32 parameters as a safetensors file\n"
        "                    (names and shapes of the model's layout; --steps 0 exports the\n"
        "                    initial weights, --resume --steps N a saved run's)\n"
        "  --export-hf DIR   at the end, write DIR/model.safetensors and DIR/config.json:\n"
        "                    the weights under GPT-2's names and layout, which Hugging\n"
        "                    Face's GPT2LMHeadModel.from_pretrained(DIR) loads as this model\n"
        "  --init FILE.safetensors | DIR\n"
        "                    start a new run from these weights (an --export or --export-hf\n"
        "                    file, or a Hugging Face GPT-2 folder: model.safetensors or its\n"
        "                    shards, and config.json; F32, BF16 or F16) instead of random\n"
        "                    ones: names, shapes, the model's size and config.json's keys are\n"
        "                    checked first, exit 2 on a mismatch; the Adam states start at\n"
        "                    zero (not with --resume)\n"
        "  --trace FILE.json write a timeline of the run (Chrome trace events: open it in\n"
        "                    ui.perfetto.dev or chrome://tracing); ZINF_TRACE=FILE does the\n"
        "                    same for any program using the library\n"
        "  --strict          treat unknown config keys as errors (exit 2), as\n"
        "                    zinf config check --strict does\n"
        "  --dry-run         resolve the config and the options, print what would run and\n"
        "                    exit (0, or 2 for what a run would refuse); opens nothing\n"
        "  --print-lr N      with --dry-run: \"lr STEP RATE\" for the first N steps (OneCycle\n"
        "                    adds \" betas BETA1 BETA2\", the betas it cycles)\n"
        "  --resume          continue the run persisted in the config's nvme_path\n"
        "  --overwrite       delete the runs saved in the config's nvme_path, by any\n"
        "                    number of ranks, and start over (without it, zinf train\n"
        "                    refuses to start over a saved run)\n"
        "  --connect SOCKET  keep the state in the job of the zinf daemon on SOCKET\n"
        "                    (zinf serve; also zinf.connect) instead of an engine of this\n"
        "                    process: its budgets and swap folder, the math here\n"
        "  --job NAME        that job (default " TRAINER_DEFAULT_JOB
        "; also zinf.job); --resume and\n"
        "                    --overwrite act on the job's saved run\n"
        "  --eval-every N    the loss on the held-out tail of --data (its last tenth,\n"
        "                    never trained on) every N steps and at the end (0: never)\n"
        "  --eval-batches N  batches of the tail that loss is the mean of (default 8)\n"
        "  --sample-every N  generate text every N steps and at the end (0: never)\n"
        "  --sample-bytes N  bytes to generate after a newline (default 64, < --seq)\n"
        "  --checkpoint-every N  make the state durable every N steps, so that a crash\n"
        "                    loses at most N - 1 steps (default 0: at the end only)\n"
        "  --precision P     auto | fp32 | bf16 | fp16: the weights and activations the\n"
        "                    device computes with; masters and Adam states stay fp32\n"
        "                    (default auto: bf16 on a GPU, fp32 on the CPU); fp16 with\n"
        "                    DeepSpeed's loss scaling (its fp16 section). On the CPU only\n"
        "                    the weights are 16-bit: activations and gradients stay fp32, so\n"
        "                    a loss scale that overflows fp16 on a GPU (2^39) does not there\n"
        "The config's zinf.train section may set layers, dim, heads, seq, batch, steps,\n"
        "seed, precision and checkpoint_every; so may DeepSpeed's keys:\n"
        "train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size,\n"
        "gradient_clipping, optimizer (Adam, AdamW or Lamb: lr, betas, eps, weight_decay,\n"
        "bias_correction; Adam's adam_w_mode; Lamb's max_coeff, min_coeff and\n"
        "eps_inside_sqrt), scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,\n"
        "LRRangeTest), bf16.enabled, fp16 (its loss scaling) and steps_per_print, \"auto\"\n"
        "included (resolved from the options, as Hugging Face's Trainer does). An option\n"
        "takes precedence over the zinf.train section, and --precision over bf16.enabled\n"
        "and fp16.enabled; an option that contradicts an explicit DeepSpeed value\n"
        "(train_micro_batch_size_per_gpu, gradient_accumulation_steps, the optimizer's\n"
        "lr and weight_decay, gradient_clipping) is refused, exit 2 (set it to \"auto\"\n"
        "or leave the option out), as is a train_batch_size other than the micro-batch\n"
        "x accumulation x ranks. The effective settings are printed at the start and are\n"
        "the first line of --log; keys zinf does not act on are named there.\n"
        "Started by zinf launch -n N (RANK, WORLD_SIZE, ZINF_COMM_NAME, ZINF_COMM_SECRET;\n"
        "ZINF_CONNECT with --connect; ZINF_COMM_TIMEOUT_MS how long the ranks wait to\n"
        "meet, ZINF_COMM_OP_TIMEOUT_MS or zinf.comm_timeout (seconds, 1800) how long a\n"
        "barrier or collective waits for a rank), it trains as one of N data-parallel\n"
        "ranks: zero_optimization.stage 1, 2 or 3 partitions the Adam states, the\n"
        "gradients and the parameters; each rank runs --accumulate micro-batches of its\n"
        "own; rank 0 prints the steps; --log FILE is rank 0's, the others write\n"
        "FILE.rank-R; a checkpoint commits only once every rank saved it, and --resume\n"
        "goes to the newest step every rank holds, also on another number of ranks.\n"
        "Exit status: 0 done, 1 failed (the last checkpoint is kept), 2 bad input,\n"
        "130/143 stopped by SIGINT/SIGTERM after flushing (129 SIGHUP, 141 SIGPIPE:\n"
        "the output's reader gone, a killed zinf launch). zinf.device picks the\n"
        "compute: a GPU (\"cuda\", or \"auto\" when one is usable) or the CPU (\"emulated\").\n");
}

static int parse_int(const char *opt, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) {
        fprintf(stderr, "zinf train: %s: expected an integer in %ld..%ld, got '%s'\n", opt, lo, hi,
                s);
        return -1;
    }
    *out = v;
    return 0;
}

static const char *const tier_names[] = {"device", "host", "nvme"};

/* Make the state durable and say what it cost: one line, and one JSON line with --log. */
/* A progress bar for a checkpoint or a resume, on a terminal: a thread that watches the
 * engine's flush (zinf_stats' flush_bytes_*) while trainer_checkpoint() runs, or the
 * engine's resume (resume_progress) while trainer_open() reads and verifies the saved
 * tensors, drawn once it has taken half a second. */
struct ckpt_watch {
    zinf_engine *e; /* NULL: the resume */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
};

static void *ckpt_watch_main(void *arg)
{
    struct ckpt_watch *w = arg;
    struct progress pg;
    progress_start(&pg, true, w->e ? "checkpoint" : "resume", 0);
    pg.delay_ns = 500000000ull;
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
        if (w->stop) break;
        pthread_mutex_unlock(&w->mu);
        struct zinf_stats st;
        uint64_t total = 0, done = 0;
        if (!w->e) {
            total = atomic_load(&resume_progress.total);
            done = atomic_load(&resume_progress.done);
        } else if (zinf_stats(w->e, &st) == 0) {
            total = st.flush_bytes_total;
            done = st.flush_bytes_done;
        }
        if (done < total) {
            pg.total = total;
            progress_show(&pg, done);
        }
        pthread_mutex_lock(&w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    progress_end(&pg);
    return NULL;
}

/* Start watching (e, or the resume with NULL) where a terminal shows it; watch_stop ends it. */
static bool watch_start(struct ckpt_watch *w, pthread_t *th, zinf_engine *e)
{
    *w = (struct ckpt_watch){.e = e};
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    return progress_wanted(false) && pthread_create(th, NULL, ckpt_watch_main, w) == 0;
}

static void watch_stop(struct ckpt_watch *w, pthread_t th, bool watching)
{
    if (watching) {
        pthread_mutex_lock(&w->mu);
        w->stop = true;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(th, NULL);
    }
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
}

/* The run's fp32 parameters, one tensor of the layout at a time: its "p.<name>" tensor, read
 * through the engine (the masters; whole on every rank but at ZeRO stage 3). */
struct param_reader {
    struct trainer *t;
    const struct gpt_tensor_desc *d;
};

static int read_param(void *ctx, int idx, float *dst)
{
    const struct param_reader *pr = ctx;
    zinf_engine *e = trainer_engine(pr->t);
    char name[64];
    zinf_tensor h;
    snprintf(name, sizeof(name), "p.%s", pr->d[idx].name);
    int r = zinf_lookup(e, name, &h);
    return r < 0 ? r : zinf_read(e, h, 0, dst, pr->d[idx].numel * sizeof(float));
}

/* --export: the fp32 parameters as a safetensors file (an 8-byte little-endian header length,
 * a JSON header giving each tensor's dtype, shape and byte range, then the data), which
 * PyTorch, Hugging Face and most other tools load. The tensors are the model's layout, in its
 * order and with its names ("wte", "h0.attn.qkv.w", ...); the metadata says the shape of the
 * model and the step. --export-hf (hf): the same weights under GPT-2's names and layout, with
 * the config.json that transformers' GPT2LMHeadModel.from_pretrained reads, in the directory
 * path. Each file is written to a temporary name and renamed once whole and synced. */
static int export_params(struct trainer *t, const struct trainer_opts *o, int step,
                         const char *path, bool hf)
{
    struct gpt_config gc = o->model;
    gc.maxT = o->seq;
    int n = gpt_layout(&gc, NULL, 0), r;
    struct gpt_tensor_desc *d = n > 0 ? calloc((size_t)n, sizeof(*d)) : NULL;
    struct param_reader pr = {.t = t, .d = d};
    char err[1024];
    if (!d || gpt_layout(&gc, d, (size_t)n) != n) {
        r = -ENOMEM;
        snprintf(err, sizeof(err), "%s: %s", path, strerror(ENOMEM));
    } else if (hf) {
        r = weights_write_hf(path, &gc, step, read_param, &pr, err, sizeof(err));
    } else {
        r = weights_write(path, &gc, step, WEIGHTS_ZINF, read_param, &pr, err, sizeof(err));
    }
    free(d);
    if (r < 0)
        fprintf(stderr, "zinf train: %s %s\n", hf ? "--export-hf" : "--export", err);
    else if (hf)
        printf("# export-hf: step %d, %d tensors under GPT-2's names, %s/model.safetensors and "
               "%s/config.json\n",
               step, n, path, path);
    else
        printf("# export: step %d, %d tensors, %s\n", step, n, path);
    return r;
}

/* --init: the file's tensors, as the trainer asks for them (trainer_opts.init_source). */
struct init_reader {
    struct weights_file *w;
    char *err;
    size_t errlen;
};

static int read_init(void *ctx, int idx, float *dst)
{
    const struct init_reader *ir = ctx;
    return weights_read(ir->w, idx, dst, ir->err, ir->errlen);
}

/* Each line of an error text (weights_open's "PATH: what" lines), said after prefix. */
static void say_lines(const char *prefix, const char *text)
{
    for (const char *p = text, *nl; *p; p = nl + 1) {
        nl = strchr(p, '\n');
        fprintf(stderr, "zinf train: %s%.*s\n", prefix, nl ? (int)(nl - p) : (int)strlen(p), p);
        if (!nl) break;
    }
}

/* ,"key":v in the log, written so that it reads back as the same value: %.9g for a float,
 * %.17g for a double; null where it is not finite (JSON has no NaN or infinity). */
static void json_num(FILE *f, const char *key, double v, bool is_float)
{
    fprintf(f, ",\"%s\":", key);
    if (!isfinite(v))
        fputs("null", f);
    else
        fprintf(f, is_float ? "%.9g" : "%.17g", v);
}

/* What a failure leaves saved: the last checkpoint, or nothing before the first. */
static void say_kept(const struct trainer_summary *sum, const char *when)
{
    if (sum->checkpoint_step < 0)
        fprintf(stderr, "zinf train: nothing of this run is saved (zinf.train.checkpoint_start "
                        "is false, and no checkpoint was made)\n");
    else
        fprintf(stderr,
                "zinf train: the state of step %d (the last checkpoint) is kept; "
                "--resume continues from there%s\n",
                sum->checkpoint_step, when);
}

/* A step's line of the log, held until its digest is known: with the update deferred to the
 * next forward, the next step (or whatever finishes the update first) gives it. */
struct held_line {
    char *line; /* up to the digest; NULL: none held */
    int step;
};

static void held_put(FILE *log, struct held_line *h, bool have, uint64_t digest)
{
    if (!h->line) return;
    fputs(h->line, log);
    if (have)
        fprintf(log, ",\"digest\":\"%016llx\"}\n", (unsigned long long)digest);
    else
        fprintf(log, ",\"digest\":null}\n");
    fflush(log);
    free(h->line);
    h->line = NULL;
}

/* The held line, with the digest the trainer has if it is that step's (its update finished),
 * else none (it failed, or the state is torn). */
static void held_put_summary(struct trainer *t, FILE *log, struct held_line *h)
{
    struct trainer_summary s;
    if (!h->line) return;
    trainer_get_summary(t, &s);
    held_put(log, h, s.have_digest && s.digest_step == h->step, s.digest);
}

static int checkpoint(struct trainer *t, FILE *log)
{
    struct trainer_summary sum;
    char a[32];
    struct ckpt_watch w;
    pthread_t th;
    bool watching = watch_start(&w, &th, trainer_engine(t));
    int r = trainer_checkpoint(t);
    watch_stop(&w, th, watching);
    if (r < 0) {
        fprintf(stderr, "zinf train: the checkpoint of step %d failed: %s%s\n",
                trainer_next_step(t) - 1, zinf_strerror(r),
                r == -ENOSPC ? " (the swap directory's filesystem is full: see the line above)"
                             : "");
        trainer_get_summary(t, &sum);
        say_kept(&sum, "");
        return r;
    }
    trainer_get_summary(t, &sum);
    printf("# checkpoint: step %d, %.1f ms, %s written\n", sum.checkpoint_step,
           sum.checkpoint_seconds * 1e3, format_size(sum.checkpoint_bytes, a, sizeof(a)));
    fflush(stdout);
    if (log) {
        fprintf(log, "{\"checkpoint\":%d", sum.checkpoint_step);
        json_num(log, "ms", sum.checkpoint_seconds * 1e3, false);
        fprintf(log, ",\"bytes_written\":%llu}\n", (unsigned long long)sum.checkpoint_bytes);
        fflush(log);
    }
    return 0;
}

/* Each line of text ("a\nb") as a JSON list of strings; with split, "path = value" lines as
 * an object. */
static void json_lines(FILE *f, const char *text, bool split)
{
    fputc(split ? '{' : '[', f);
    for (const char *p = text, *nl; p && *p; p = nl ? nl + 1 : NULL) {
        char line[512];
        nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        snprintf(line, sizeof(line), "%.*s", (int)n, p);
        if (p != text) fputc(',', f);
        char *eq = split ? strstr(line, " = ") : NULL;
        if (eq) {
            *eq = '\0';
            json_print_string(f, line);
            fputc(':', f);
            json_print_string(f, eq + 3);
        } else {
            json_print_string(f, line);
        }
    }
    fputc(split ? '}' : ']', f);
}

/* Each line of text ("a\nb"), after prefix. */
static void print_lines(const char *prefix, const char *text)
{
    for (const char *p = text, *nl; *p; p = nl + 1) {
        nl = strchr(p, '\n');
        printf("%s%.*s\n", prefix, nl ? (int)(nl - p) : (int)strlen(p), p);
        if (!nl) break;
    }
}

/* The effective settings, once: a few lines here, the first JSON line of the log. */
static void print_settings(const struct trainer_opts *o, const struct train_config_applied *ds,
                           const struct trainer_summary *sum, long ckpt_every, int every, FILE *log)
{
    printf("# settings: %d micro-batch%s of %d x %d tokens per step, %d steps, %s lr %g (%s "
           "schedule), betas %g %g, eps %g, weight decay %g, clip %g, seed %llu, checkpoint "
           "every %ld, print every %d\n",
           o->grad_accum, o->grad_accum == 1 ? "" : "es", o->batch, o->seq, o->steps, ds->optimizer,
           o->lr, ds->scheduler, o->beta1, o->beta2, o->eps, o->weight_decay, o->grad_clip,
           (unsigned long long)o->seed, ckpt_every, every);
    print_lines("# \"auto\": ", ds->autos);
    if (ds->ignored[0]) {
        printf("# ignored (in the config, but zinf does not act on these):\n");
        print_lines("#   ", ds->ignored);
    }
    if (!log) return;
    fprintf(log,
            "{\"settings\":{\"layers\":%d,\"dim\":%d,\"heads\":%d,\"seq\":%d,"
            "\"batch\":%d,\"grad_accum\":%d,\"steps\":%d,\"optimizer\":",
            o->model.L, o->model.C, o->model.NH, o->seq, o->batch, o->grad_accum, o->steps);
    json_print_string(log, ds->optimizer);
    fprintf(log, ",\"lr\":%.9g,\"scheduler\":", o->lr);
    json_print_string(log, ds->scheduler);
    json_num(log, "warmup_min_lr", o->sched.min_lr, false);
    json_num(log, "warmup_max_lr", o->sched.max_lr, false);
    fprintf(log,
            ",\"warmup_steps\":%d,"
            "\"total_steps\":%d,\"warmup_type\":\"%s\",\"betas\":[%.9g,%.9g],\"eps\":%.9g,"
            "\"weight_decay\":%.9g,\"clip\":%.9g,\"seed\":%llu,\"precision\":\"%s\","
            "\"backend\":\"%s\",\"checkpoint_every\":%ld,\"steps_per_print\":%d,"
            "\"device_bytes\":%llu,\"host_bytes\":%llu,\"min_device_bytes\":%llu,"
            "\"min_host_bytes\":%llu,\"staging_bytes\":%llu,\"auto\":",
            o->sched.warmup_steps, o->sched.total_steps,
            o->sched.linear ? "linear" : "log", o->beta1, o->beta2, o->eps, o->weight_decay,
            o->grad_clip, (unsigned long long)o->seed, sum->precision, sum->backend, ckpt_every,
            every, (unsigned long long)sum->tier[0].budget_bytes,
            (unsigned long long)sum->tier[1].budget_bytes, (unsigned long long)sum->min_budget[0],
            (unsigned long long)sum->min_budget[1], (unsigned long long)sum->staging_bytes);
    json_lines(log, ds->autos, true);
    fprintf(log, ",\"ignored\":");
    json_lines(log, ds->ignored, false);
    fprintf(log, "}}\n");
    fflush(log);
}

/* b - a in seconds: the CPU time a step took, for the log. */
static double timeval_diff_s(const struct timeval *a, const struct timeval *b)
{
    return (double)(b->tv_sec - a->tv_sec) + (double)(b->tv_usec - a->tv_usec) * 1e-6;
}

/* The CPU seconds this process's threads have used, summed by thread name (the engine
 * names its own: zinf-copy, zinf-reap, zinf-io, zinf-comm, zinf-trace), from
 * /proc/self/task. A thread
 * that ended takes its time with it: per step, the deltas of the threads that live on. */
#define CPU_NAMES 8
struct cpu_names {
    int n;
    char name[CPU_NAMES][16];
    double s[CPU_NAMES];
};

static void cpu_by_thread(struct cpu_names *c)
{
    static long tck;
    if (!tck) tck = sysconf(_SC_CLK_TCK);
    for (int k = 0; k < c->n; k++)
        c->s[k] = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d || tck <= 0) {
        if (d) closedir(d);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        char path[300], buf[512];
        if (de->d_name[0] == '.') continue;
        snprintf(path, sizeof(path), "/proc/self/task/%s/stat", de->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue; /* ended meanwhile */
        size_t len = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[len] = 0;
        char *open = strchr(buf, '('), *close = strrchr(buf, ')');
        unsigned long long ut, st;
        if (!open || !close || close < open ||
            sscanf(close + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut,
                   &st) != 2)
            continue;
        /* The engine's threads by their names; io_uring's kernel workers (iou-*) as one; the
         * rest (the main thread and the compute threads) as "compute". */
        char name[16];
        size_t nl = (size_t)(close - open - 1);
        if (nl > 5 && !strncmp(open + 1, "zinf-", 5))
            snprintf(name, sizeof(name), "%.*s", (int)MIN(nl, sizeof(name) - 1), open + 1);
        else
            snprintf(name, sizeof(name), "%s",
                     !strncmp(open + 1, "iou-", 4) ? "io_uring" : "compute");
        int k = 0;
        while (k < c->n && strcmp(c->name[k], name)) k++;
        if (k == c->n) {
            if (c->n < CPU_NAMES) {
                snprintf(c->name[c->n], sizeof(c->name[0]), "%s", name);
                c->s[c->n++] = 0;
            } else {
                k = CPU_NAMES - 1; /* more names than slots: the last one takes the rest */
            }
        }
        c->s[k] += (double)(ut + st) / (double)tck;
    }
    closedir(d);
}

static const char *format_eta(double s, char *buf, size_t len)
{
    long n = (long)(s + 0.5);
    if (n < 60)
        snprintf(buf, len, "%lds", n);
    else if (n < 3600)
        snprintf(buf, len, "%ldm%02lds", n / 60, n % 60);
    else
        snprintf(buf, len, "%ldh%02ldm", n / 3600, n % 3600 / 60);
    return buf;
}

/* The held-out loss: a line, and a JSON line with --log. */
static int evaluate(struct trainer *t, int step, int batches, FILE *log)
{
    float loss;
    int r = trainer_eval(t, batches, &loss);
    if (r < 0) {
        fprintf(stderr, "zinf train: the validation at step %d failed: %s\n", step,
                r == -ENODATA ? "the data holds no tail to validate on" : zinf_strerror(r));
        return r;
    }
    printf("# eval: step %d, val loss %.4f (%d batches of the held-out tail)\n", step, loss,
           batches);
    fflush(stdout);
    if (log) {
        fprintf(log, "{\"eval\":%d", step);
        json_num(log, "val_loss", loss, true);
        fprintf(log, ",\"batches\":%d}\n", batches);
        fflush(log);
    }
    return 0;
}

/* Text generated after a newline: a line (bytes shown as C escapes where they are not
 * printable), and a JSON line with --log. */
static int sample(struct trainer *t, int step, uint64_t seed, long bytes, FILE *log)
{
    static const unsigned char prompt[] = "\n";
    unsigned char *out = malloc((size_t)bytes);
    int n = out ? trainer_sample(t, seed ^ (uint64_t)step, prompt, 1, out, (size_t)bytes) : -ENOMEM;
    if (n < 0) {
        free(out);
        fprintf(stderr, "zinf train: sampling at step %d failed: %s\n", step, zinf_strerror(n));
        return n;
    }
    printf("# sample: step %d: \"", step);
    for (int i = 0; i < n; i++) {
        unsigned char c = out[i];
        if (c == '\n')
            fputs("\\n", stdout);
        else if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c >= 0x20 && c < 0x7f)
            putchar(c);
        else
            printf("\\x%02x", c);
    }
    printf("\"\n");
    fflush(stdout);
    if (log) {
        /* JSON strings are UTF-8: bytes past ASCII are written as \u00XX, one per byte. */
        fprintf(log, "{\"sample\":%d,\"bytes\":%d,\"text\":\"", step, n);
        for (int i = 0; i < n; i++) {
            unsigned char c = out[i];
            if (c == '"' || c == '\\')
                fprintf(log, "\\%c", c);
            else if (c < 0x20 || c >= 0x7f)
                fprintf(log, "\\u%04x", c);
            else
                fputc(c, log);
        }
        fprintf(log, "\"}\n");
        fflush(log);
    }
    free(out);
    return 0;
}

int cmd_train(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'},
        {"data", required_argument, NULL, 'd'},
        TRAIN_SHAPE_OPTIONS, /* --layers ... --accumulate: train_option_apply() takes them */
        {"log", required_argument, NULL, O_LOG},
        {"resume", no_argument, NULL, O_RESUME},
        {"overwrite", no_argument, NULL, O_OVERWRITE},
        {"checkpoint-every", required_argument, NULL, O_CKPT},
        {"eval-every", required_argument, NULL, O_EVAL},
        {"eval-batches", required_argument, NULL, O_EVAL_BATCHES},
        {"sample-every", required_argument, NULL, O_SAMPLE},
        {"sample-bytes", required_argument, NULL, O_SAMPLE_BYTES},
        {"connect", required_argument, NULL, O_CONNECT},
        {"job", required_argument, NULL, O_JOB},
        {"trace", required_argument, NULL, O_TRACE},
        {"export", required_argument, NULL, O_EXPORT},
        {"export-hf", required_argument, NULL, O_EXPORT_HF},
        {"init", required_argument, NULL, O_INIT},
        {"strict", no_argument, NULL, O_STRICT},
        {"dry-run", no_argument, NULL, O_DRY_RUN},
        {"print-lr", required_argument, NULL, O_PRINT_LR},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    struct trainer_opts o;
    struct trainer *t = NULL;
    int steps_per_print = 1;
    long eval_every = 0, eval_batches = 8, sample_every = 0, sample_bytes = 0;
    const char *log_path = NULL, *trace_path = NULL, *export_path = NULL;
    const char *export_hf = NULL, *init_path = NULL; /* --export-hf DIR, --init FILE */
    struct weights_file *init = NULL;                 /* --init's file, checked */
    FILE *log = NULL;
    char err[512];
    long v = 0;
    int ch, r, status = 0;
    unsigned given = 0;   /* bit (option - O_LAYERS) for each model/run option given */
    long ckpt_every = -1; /* -1: not given */
    bool ckpt_failed = false;
    bool strict = false;  /* --strict: unknown config keys are errors */
    bool dry_run = false; /* --dry-run: decide what would run, run nothing */
    long print_lr = 0;    /* --print-lr N: with --dry-run, the first N steps' learning rates */

    trainer_opts_defaults(&o);
    /* Started as one of several ranks (zinf launch -n N): the trainer partitions the state
     * by zero_optimization.stage, and this rank runs its own micro-batches. */
    const char *ws = getenv("WORLD_SIZE"), *rk = getenv("RANK");
    if (ws && *ws) {
        char *e1 = NULL, *e2 = NULL;
        long w = strtol(ws, &e1, 10), k = rk && *rk ? strtol(rk, &e2, 10) : -1;
        if (*e1 || w < 1 || w > 64 || !e2 || *e2 || k < 0 || k >= w) {
            fprintf(stderr,
                    "zinf train: WORLD_SIZE '%s' and RANK '%s': expected 1 <= WORLD_SIZE <= 64 "
                    "and 0 <= RANK < WORLD_SIZE (zinf launch sets them)\n",
                    ws, rk ? rk : "");
            return 2;
        }
        o.world = (int)w;
        o.rank = (int)k;
        /* On GPUs each rank takes the GPU of its LOCAL_RANK. */
        const char *lr = getenv("LOCAL_RANK");
        if (lr && *lr) {
            char *e3 = NULL;
            long l = strtol(lr, &e3, 10);
            if (*e3 || l < 0 || l >= 64) {
                fprintf(stderr, "zinf train: LOCAL_RANK '%s': expected 0 <= LOCAL_RANK < 64 "
                                "(zinf launch sets it)\n", lr);
                return 2;
            }
            o.local_rank = (int)l;
        }
        o.comm_name = getenv("ZINF_COMM_NAME");
        /* zinf launch --connect: every rank's state in the one daemon. */
        const char *zc = getenv("ZINF_CONNECT");
        if (zc && *zc) o.connect = zc;
        o.comm_secret = getenv("ZINF_COMM_SECRET");
        if (o.comm_secret && !comm_secret_ok(o.comm_secret)) {
            fprintf(stderr, "zinf train: ZINF_COMM_SECRET: expected %d lowercase hex digits (zinf "
                            "launch sets it)\n", COMM_SECRET_HEX);
            return 2;
        }
        /* The rendezvous's and the collectives' deadlines: for tests, and for machines where
         * the defaults do not fit (zinf.comm_timeout sets the latter in the config). */
        const char *tv[2] = {"ZINF_COMM_TIMEOUT_MS", "ZINF_COMM_OP_TIMEOUT_MS"};
        unsigned *tp[2] = {&o.comm_timeout_ms, &o.comm_op_timeout_ms};
        for (int ev = 0; ev < 2; ev++) {
            const char *to = getenv(tv[ev]);
            if (!to || !*to) continue;
            char *e3 = NULL;
            errno = 0;
            long ms = strtol(to, &e3, 10);
            if (*e3 || errno || ms < 1 || ms > 86400000) {
                fprintf(stderr, "zinf train: %s '%s': expected milliseconds in 1..86400000\n",
                        tv[ev], to);
                return 2;
            }
            *tp[ev] = (unsigned)ms;
        }
    }
    optind = 1;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "c:d:h", longopts, NULL)) != -1) {
        int bad = 0;
        /* The model's and the run's shape, as zinf config check takes them too. */
        int shape = train_option_apply(ch, optarg, &o, &given, err, sizeof(err));
        if (shape < 0) {
            fprintf(stderr, "zinf train: %s\n", err);
            usage(stderr);
            return 2;
        }
        if (shape > 0) continue;
        switch (ch) {
        case 'c':
            o.config_path = optarg;
            break;
        case 'd':
            o.data_path = optarg;
            break;
        case O_LOG:
            log_path = optarg;
            break;
        case O_RESUME:
            o.resume = true;
            break;
        case O_OVERWRITE:
            o.overwrite = true;
            break;
        case O_CONNECT:
            o.connect = optarg;
            break;
        case O_TRACE:
            trace_path = optarg;
            break;
        case O_EXPORT:
            export_path = optarg;
            break;
        case O_EXPORT_HF:
            export_hf = optarg;
            break;
        case O_INIT:
            init_path = optarg;
            break;
        case O_STRICT:
            strict = true;
            break;
        case O_DRY_RUN:
            dry_run = true;
            break;
        case O_PRINT_LR:
            bad = parse_int("--print-lr", optarg, 1, 100000000, &v);
            print_lr = v;
            break;
        case O_JOB:
            o.job = optarg;
            break;
        case O_CKPT:
            bad = parse_int("--checkpoint-every", optarg, 0, 100000000, &ckpt_every);
            break;
        case O_EVAL:
            bad = parse_int("--eval-every", optarg, 0, 100000000, &eval_every);
            break;
        case O_EVAL_BATCHES:
            bad = parse_int("--eval-batches", optarg, 1, 100000, &eval_batches);
            break;
        case O_SAMPLE:
            bad = parse_int("--sample-every", optarg, 0, 100000000, &sample_every);
            break;
        case O_SAMPLE_BYTES:
            bad = parse_int("--sample-bytes", optarg, 1, 65535, &sample_bytes);
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            fprintf(stderr, "zinf train: unknown or incomplete option '%s'\n", argv[optind - 1]);
            bad = 1;
        }
        if (bad) {
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "zinf train: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (o.resume && o.overwrite) {
        fprintf(stderr, "zinf train: --resume and --overwrite: continue the saved run, or delete "
                        "it; not both\n");
        return 2;
    }
    if (init_path && o.resume) {
        fprintf(stderr, "zinf train: --init and --resume: --init starts a new run from the "
                        "file's weights, --resume continues the saved one; not both (the saved "
                        "run is left as it is)\n");
        return 2;
    }
    if (print_lr && !dry_run) {
        fprintf(stderr, "zinf train: --print-lr goes with --dry-run\n");
        return 2;
    }
    if (!o.config_path || !o.data_path) {
        fprintf(stderr, "zinf train: --config FILE and --data FILE are required\n");
        usage(stderr);
        return 2;
    }
    /* The config's zinf.train section fills what the command line left out. */
    struct zinf_config zc;
    if (config_parse_file(o.config_path, &zc, err, sizeof(err)) < 0) {
        fprintf(stderr, "zinf train: %s\n", err);
        config_free(&zc);
        return 2;
    }
    if (strict && zc.n_unknown) {
        fprintf(stderr, "zinf train: %s: %zu unknown key%s (--strict)\n", o.config_path,
                zc.n_unknown, zc.n_unknown == 1 ? "" : "s");
        config_free(&zc);
        return 2;
    }
    if (ckpt_every < 0) ckpt_every = zc.zinf.train.checkpoint_every;
    struct train_config_applied ds = {0};
    if (train_config_apply(&zc, &o, given, &ds, err, sizeof(err)) < 0) {
        fprintf(stderr, "zinf train: %s: %s\n", o.config_path, err);
        config_free(&zc);
        return 2;
    }
    steps_per_print = zc.train.steps_per_print ? zc.train.steps_per_print : 1;
    bool nvme_offload = zc.zero.offload_param.device == CONFIG_OFFLOAD_NVME ||
                        zc.zero.offload_optimizer.device == CONFIG_OFFLOAD_NVME;
    config_free(&zc);
    o.sample = sample_every > 0;
    if (sample_bytes == 0) sample_bytes = MIN(64, o.seq - 1);
    if (o.sample && sample_bytes > o.seq - 1) {
        fprintf(stderr,
                "zinf train: --sample-bytes %ld: at most --seq - 1 = %d (the context "
                "is one sequence)\n",
                sample_bytes, o.seq - 1);
        return 2;
    }
    /* --init's file is checked whole against the model before anything opens, so that a
     * mismatch refuses the run having touched nothing (a dry run says it too). */
    if (init_path) {
        struct gpt_config gc = o.model;
        gc.maxT = o.seq;
        char werr[4096];
        r = weights_open(init_path, &gc, &init, werr, sizeof(werr));
        if (r < 0) {
            say_lines("--init ", werr);
            return r == -ENOMEM ? 1 : 2;
        }
    }
    if (dry_run) {
        /* What would run, decided as config check decides it; nothing is opened. The
         * budgets are judged as trainer_open judges them, a run they would refuse refused
         * here in its words. */
        struct trainer_plan pl;
        if ((r = trainer_plan(&o, &pl, err, sizeof(err))) < 0 ||
            (r = trainer_plan_check(&pl, err, sizeof(err))) < 0) {
            fprintf(stderr, "zinf train: %s\n", err[0] ? err : zinf_strerror(r));
            weights_close(init);
            return r == -ENOMEM ? 1 : 2;
        }
        printf("# zinf train --dry-run: %d layers, dim %d, %d heads, seq %d, %d micro-batch%s "
               "of %d per step, %d steps, %s lr %g (%s schedule), betas %g %g, eps %g, "
               "weight decay %g, clip %g, seed %llu\n",
               o.model.L, o.model.C, o.model.NH, o.seq, o.grad_accum,
               o.grad_accum == 1 ? "" : "es", o.batch, o.steps, ds.optimizer, o.lr,
               ds.scheduler, o.beta1, o.beta2, o.eps, o.weight_decay, o.grad_clip,
               (unsigned long long)o.seed);
        print_lines("# \"auto\": ", ds.autos);
        if (ds.ignored[0]) {
            printf("# ignored (in the config, but zinf does not act on these):\n");
            print_lines("#   ", ds.ignored);
        }
        /* OneCycle's cycled betas too, where it sets them. */
        bool betas = o.sched.type == TRAINER_SCHED_ONE_CYCLE && o.sched.cycle_momentum;
        for (long s = 1; s <= print_lr; s++) {
            double b1, b2;
            trainer_betas_at(&o.sched, o.beta1, o.beta2, (int)s, &b1, &b2);
            printf("lr %ld %.17g", s, trainer_lr_at(&o.sched, o.lr, (int)s));
            if (betas) printf(" betas %.17g %.17g", b1, b2);
            putchar('\n');
        }
        if (init)
            printf("# --init %s: %d tensors under %s, as this model has them\n", init_path,
                   4 + GPT_BLOCK_NSLOTS * o.model.L, weights_file_names(init) == WEIGHTS_ZINF
                                                        ? "zinf's names"
                                                        : "GPT-2's names");
        if (init && weights_file_notes(init)[0])
            printf("# --init: %s\n", weights_file_notes(init));
        weights_close(init);
        return fflush(stdout) == 0 ? 0 : 1;
    }
    /* Across ranks, rank 0 writes the log and the others LOG.rank-R beside it. */
    char rank_log[4096];
    if (log_path && o.rank > 0) {
        snprintf(rank_log, sizeof(rank_log), "%s.rank-%d", log_path, o.rank);
        log_path = rank_log;
    }
    /* The log carries each step's parameter digest (every rank has --log when one has:
     * they share the command line, and the digest is summed across them). */
    o.digest = log_path != NULL;
    /* Appending, so that a run refused below leaves an old log as it was. */
    if (log_path && !(log = fopen(log_path, "a"))) {
        fprintf(stderr, "zinf train: --log %s: %s\n", log_path, strerror(errno));
        weights_close(init);
        return 2;
    }

    /* The trace, before anything it shows; other ranks write FILE.rank-R. Whatever path
     * leaves from here, the file is closed at exit. */
    char rank_trace[4096];
    if (trace_path && o.rank > 0) {
        snprintf(rank_trace, sizeof(rank_trace), "%s.rank-%d", trace_path, o.rank);
        trace_path = rank_trace;
    }
    if (trace_path) {
        if ((r = trace_start(trace_path)) < 0) {
            fprintf(stderr, "zinf train: --trace %s: %s\n", trace_path,
                    r == -EALREADY ? "a trace is being written already" : strerror(-r));
            if (log) fclose(log);
            weights_close(init);
            return 2;
        }
        atexit(stop_trace);
    }

    /* From here a signal only asks the loop to stop: even during set-up. A SIGHUP that
     * was ignored when we started (nohup) stays ignored. */
    struct sigaction sa = {.sa_handler = on_signal}, was;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (sigaction(SIGHUP, NULL, &was) == 0 && was.sa_handler != SIG_IGN)
        sigaction(SIGHUP, &sa, NULL);
    sa.sa_handler = on_sigpipe;
    sigaction(SIGPIPE, &sa, NULL);

    struct ckpt_watch rw;
    pthread_t rth;
    bool rwatching = o.resume && watch_start(&rw, &rth, NULL);
    o.stop = &stop_requested; /* the ranks' rendezvous gives up on a signal */
    /* --init: the file's weights are the new run's, in every copy the trainer keeps (and on
     * every rank), before its step 0 is saved. */
    char werr[1024] = "";
    struct init_reader ir = {.w = init, .err = werr, .errlen = sizeof(werr)};
    if (init) {
        o.init_source = read_init;
        o.init_ctx = &ir;
    }
    r = trainer_open(&o, &t, err, sizeof(err));
    if (o.resume) watch_stop(&rw, rth, rwatching);
    if (r < 0 && werr[0]) {
        fprintf(stderr, "zinf train: --init %s\n", werr);
        if (log) fclose(log);
        weights_close(init);
        return 1;
    }
    if (r < 0) {
        fprintf(stderr, "zinf train: %s\n", err[0] ? err : zinf_strerror(r));
        if (log) fclose(log);
        weights_close(init);
        if (r == -EINTR && stop_requested) return 128 + stop_requested;
        return r == -EINVAL || r == -ENOENT || r == -EISDIR || r == -EACCES || r == -ENODEV ||
                       r == -EEXIST || r == -ENOTDIR || r == -ENOTSUP
                   ? 2
                   : 1;
    }

    /* A new run's log starts empty, once the run is known to start. */
    if (log && !o.resume && ftruncate(fileno(log), 0) != 0) {
        fprintf(stderr, "zinf train: --log %s: %s\n", log_path, strerror(errno));
        fclose(log);
        trainer_close(t);
        weights_close(init);
        return 2;
    }
    /* --export reads each weight whole: across ranks at stage 3 each holds shards. */
    if (export_path || export_hf) {
        struct trainer_summary es;
        trainer_get_summary(t, &es);
        if (es.world > 1 && es.stage >= 3) {
            fprintf(stderr,
                    "zinf train: %s: at ZeRO stage 3 each of the %d ranks holds a shard of "
                    "every weight; export on one rank (zinf train --resume --steps N %s "
                    "%s re-cuts the saved run for it) or at stage 1 or 2\n",
                    export_path ? "--export" : "--export-hf", es.world,
                    export_path ? "--export" : "--export-hf", export_path ? "FILE" : "DIR");
            if (log) fclose(log);
            trainer_close(t);
            weights_close(init);
            return 2;
        }
    }
    /* Rank 0 speaks for the job; the others say only their summary (and errors). */
    int saved_stdout = -1;
    if (o.rank > 0) {
        fflush(stdout);
        saved_stdout = dup(STDOUT_FILENO);
        int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (null >= 0) {
            dup2(null, STDOUT_FILENO);
            close(null);
        }
    }
    struct trainer_summary sum;
    trainer_get_summary(t, &sum);
    char a[32], b[32], c[32];
    printf("# zinf train: %d layers, dim %d, %d heads, seq %d, batch %d: %llu parameters, "
           "model state %s\n",
           o.model.L, o.model.C, o.model.NH, o.seq, o.batch, (unsigned long long)sum.param_count,
           format_size(sum.model_state_bytes, a, sizeof(a)));
    char d[32], f[32], g[32];
    printf("# budgets: device %s, host %s (the least that runs: %s, %s); beside the host "
           "budget, %s of staging buffers%s%s\n",
           format_size(sum.tier[0].budget_bytes, b, sizeof(b)),
           format_size(sum.tier[1].budget_bytes, c, sizeof(c)),
           format_size(sum.min_budget[0], d, sizeof(d)),
           format_size(sum.min_budget[1], f, sizeof(f)),
           format_size(sum.staging_bytes, g, sizeof(g)), sum.host_pinned ? ", pinned too" : "",
           o.resume ? "; resumed" : "");
    /* The budgets the config did not give, and how they were derived. */
    if (sum.budgets.device_how[0]) printf("#   device budget: %s\n", sum.budgets.device_how);
    if (sum.budgets.host_how[0]) printf("#   host budget: %s\n", sum.budgets.host_how);
    /* An NVMe offload whose whole state fits in memory: NVMe will see the checkpoints only. */
    if (nvme_offload && sum.world <= 1 &&
        sum.model_state_bytes <= sum.tier[0].budget_bytes + sum.tier[1].budget_bytes) {
        char s1[32];
        fprintf(stderr,
                "zinf train: warning: the config offloads to NVMe, but the whole model state "
                "(%s) fits the device and host budgets (%s + %s): nothing will move to NVMe "
                "between checkpoints; lower zinf.device_bytes and zinf.host_bytes to offload\n",
                format_size(sum.model_state_bytes, s1, sizeof(s1)), b, c);
    }
    if (init) {
        printf("# init: %d tensors from %s (%s), saved as step 0\n",
               4 + GPT_BLOCK_NSLOTS * o.model.L, init_path,
               weights_file_names(init) == WEIGHTS_ZINF ? "zinf's names" : "GPT-2's names");
        if (weights_file_notes(init)[0]) printf("# init: %s\n", weights_file_notes(init));
        weights_close(init);
        init = NULL;
    }
    if (o.resume && trainer_next_step(t) > o.steps) {
        /* Nothing to run: say so rather than exit 0 having done nothing. */
        int done = trainer_next_step(t) - 1;
        if (done > o.steps) {
            fprintf(stderr,
                    "zinf train: --steps %d --resume: the saved run is at step %d "
                    "already, past %d; give --steps above %d to continue it\n",
                    o.steps, done, o.steps, done);
            if (log) fclose(log);
            trainer_close(t);
            return 2;
        }
        /* At its last step: said, and the summary follows as after any run. */
        printf("# the saved run has done its %d steps already: nothing to do (a larger "
               "--steps continues it)\n",
               done);
    }
    printf("# compute: %s, %s weights on the device%s%s\n", sum.backend, sum.precision,
           sum.backend_work_bytes ? "; backend working memory " : "",
           sum.backend_work_bytes ? format_size(sum.backend_work_bytes, a, sizeof(a)) : "");
    print_settings(&o, &ds, &sum, ckpt_every, steps_per_print, log);
    printf("# %6s %9s %10s %9s %9s %9s %8s %20s %8s\n", "step", "loss", "tokens/s", "ms",
           "rd GB/s", "wr GB/s", "blocked", "nvme/copy/room/pin %", "eta");
    fflush(stdout);

    int ran = 0;
    double ran_seconds = 0;
    struct cpu_names cpu_names = {0};
    double blocked_s[5] = {0}; /* blocked in fetch; of it nvme, copy, room, pin */
    struct held_line held = {0};
    while (trainer_next_step(t) <= o.steps) {
        /* Every rank stops after the same step (a signal reaches each at its own time). */
        if (trainer_any_rank(t, stop_requested != 0)) {
            if (!stop_requested) stop_requested = SIGTERM;
            break;
        }
        struct trainer_step_stats st;
        struct rusage ru0, ru1;
        struct cpu_names c0 = cpu_names, c1 = cpu_names;
        if (log) cpu_by_thread(&c0);
        getrusage(RUSAGE_SELF, &ru0);
        r = trainer_step(t, &st);
        getrusage(RUSAGE_SELF, &ru1);
        if (log) {
            c1 = c0;
            cpu_by_thread(&c1);
            cpu_names = c1;
        }
        if (r < 0) {
            fprintf(stderr, "zinf train: step %d failed: %s%s\n", trainer_next_step(t),
                    zinf_strerror(r),
                    r == -ENOMEM   ? " (a set the step pins did not fit, although the budgets "
                                     "were checked at open against the largest one: a bug; "
                                     "please report it with this command line)"
                    : r == -ENOSPC ? " (the swap directory's filesystem is full: see the line "
                                     "above for what is needed)"
                                   : "");
            status = 1;
            break;
        }
        ran++;
        ran_seconds += st.seconds;
        blocked_s[0] += st.blocked_fraction * st.seconds;
        blocked_s[1] += st.blocked_nvme * st.seconds;
        blocked_s[2] += st.blocked_copy * st.seconds;
        blocked_s[3] += st.blocked_room * st.seconds;
        blocked_s[4] += st.blocked_pin * st.seconds;
        double eta = ran_seconds / ran * (o.steps - st.step);
        if (st.step % steps_per_print == 0 || st.step == o.steps) {
            char e[32];
            char why[48];
            snprintf(why, sizeof(why), "%.0f/%.0f/%.0f/%.0f", st.blocked_nvme * 100,
                     st.blocked_copy * 100, st.blocked_room * 100, st.blocked_pin * 100);
            printf("  %6d %9.4f %10.0f %9.1f %9.3f %9.3f %7.1f%% %20s %8s%s", st.step, st.loss,
                   st.tokens_per_s, st.seconds * 1e3, st.nvme_read_GBps, st.nvme_write_GBps,
                   st.blocked_fraction * 100, why, format_eta(eta, e, sizeof(e)),
                   st.skipped ? "  skipped: the gradients overflowed" : "");
            if (st.skipped || (sum.precision[0] == 'f' && sum.precision[2] == '1'))
                printf("  (loss scale %.9g)", st.loss_scale);
            printf("\n");
            fflush(stdout);
        }
        /* The line before waited for its digest: an update deferred to this step's forward
         * gave it. Out first, so that a failure to make this step's line loses no more. */
        if (held.line && st.have_digest && st.digest_step == held.step)
            held_put(log, &held, true, st.digest);
        char *line = NULL;
        size_t line_len = 0;
        FILE *ln = log ? open_memstream(&line, &line_len) : NULL;
        if (log && !ln) {
            fprintf(stderr, "zinf train: --log: %s\n", strerror(errno));
            status = 1;
            break;
        }
        if (ln) {
            /* Every number reads back as the value the trainer had (json_num), so runs can
             * be compared exactly from their logs; the digest compares their parameters. */
            fprintf(ln, "{\"step\":%d", st.step);
            json_num(ln, "loss", st.loss, true);
            json_num(ln, "tokens_per_s", st.tokens_per_s, false);
            json_num(ln, "ms", st.seconds * 1e3, false);
            json_num(ln, "nvme_read_GBps", st.nvme_read_GBps, false);
            json_num(ln, "nvme_write_GBps", st.nvme_write_GBps, false);
            json_num(ln, "blocked", st.blocked_fraction, false);
            json_num(ln, "blocked_nvme", st.blocked_nvme, false);
            json_num(ln, "blocked_copy", st.blocked_copy, false);
            json_num(ln, "blocked_room", st.blocked_room, false);
            json_num(ln, "blocked_pin", st.blocked_pin, false);
            fprintf(ln, ",\"device_used_bytes\":%llu,\"host_used_bytes\":%llu",
                    (unsigned long long)st.device_used, (unsigned long long)st.host_used);
            json_num(ln, "eta_s", eta, false);
            json_num(ln, "loss_scale", st.loss_scale, false);
            fprintf(ln, ",\"skipped\":%s", st.skipped ? "true" : "false");
            json_num(ln, "grad_norm", st.grad_norm, false);
            json_num(ln, "clip_scale", st.clip_scale, true);
            json_num(ln, "lr", st.lr, true);
            json_num(ln, "cpu_user_s", timeval_diff_s(&ru0.ru_utime, &ru1.ru_utime), false);
            json_num(ln, "cpu_sys_s", timeval_diff_s(&ru0.ru_stime, &ru1.ru_stime), false);
            fprintf(ln, ",\"cpu_by_thread\":{");
            for (int k = 0; k < c1.n; k++) {
                fprintf(ln, "%s\"%s\":", k ? "," : "", c1.name[k]);
                /* a name first seen after the step began started from nothing */
                fprintf(ln, "%.3f", c1.s[k] - (k < c0.n ? c0.s[k] : 0));
            }
            fprintf(ln, "}");
            fclose(ln);
            /* A line still held has no digest to wait for (its update failed, or the state
             * is torn). This one waits for its own where its update is deferred. */
            held_put_summary(t, log, &held);
            held = (struct held_line){.line = line, .step = st.step};
            if (!(st.update_pending && o.digest))
                held_put(log, &held, st.have_digest && st.digest_step == st.step, st.digest);
        }
        bool end = st.step == o.steps;
        bool evaluating = eval_every > 0 && (st.step % eval_every == 0 || end),
             sampling = sample_every > 0 && (st.step % sample_every == 0 || end),
             saving = ckpt_every > 0 && st.step % ckpt_every == 0 && st.step < o.steps;
        /* Their lines come after the step's, which its finished update completes. */
        if (held.line && (evaluating || sampling || saving)) {
            trainer_finish_update(t);
            held_put_summary(t, log, &held);
        }
        if (eval_every > 0 && (st.step % eval_every == 0 || end) &&
            evaluate(t, st.step, (int)eval_batches, log) < 0) {
            status = 1;
            break;
        }
        if (sample_every > 0 && (st.step % sample_every == 0 || end) &&
            sample(t, st.step, o.seed, sample_bytes, log) < 0) {
            status = 1;
            break;
        }
        if (ckpt_every > 0 && st.step % ckpt_every == 0 && st.step < o.steps) {
            r = checkpoint(t, log);
            if (r < 0) {
                status = 1;
                ckpt_failed = true;
                break;
            }
        }
    }
    if (held.line) {
        trainer_finish_update(t); /* its failure is the checkpoint's below */
        held_put_summary(t, log, &held);
    }
    trainer_get_summary(t, &sum);
    if (sum.torn) {
        /* Half of the failed step's updates are in memory: the last checkpoint stays. */
        say_kept(&sum, " once the cause is fixed");
    } else if (!ckpt_failed) {
        r = checkpoint(t, log);
        if (r < 0)
            status = 1;
        else if (status)
            fprintf(stderr,
                    "zinf train: the state of step %d is saved; --resume continues "
                    "from there once the cause is fixed\n",
                    sum.steps_done);
    }
    bool exporting = o.rank == 0 && !sum.torn && !ckpt_failed && (status == 0 || stop_requested);
    if (exporting && export_path && export_params(t, &o, sum.steps_done, export_path, false) < 0)
        status = 1;
    if (exporting && export_hf && export_params(t, &o, sum.steps_done, export_hf, true) < 0)
        status = 1;
    if (status == 0 && stop_requested) {
        printf("# %s: finishing here, the state is flushed (continue with --resume)\n",
               stop_name(stop_requested));
        status = 128 + stop_requested;
    }
    trainer_get_summary(t, &sum);
    if (saved_stdout >= 0) {
        fflush(stdout);
        dup2(saved_stdout, STDOUT_FILENO);
        close(saved_stdout);
    }
    double mean_tps =
        ran_seconds > 0 ? (double)ran * o.batch * o.seq * o.grad_accum * sum.world / ran_seconds
                        : 0;
    printf("# summary: %d steps, model state %s; a tier was emptied %llu times to place a set "
           "it held room for\n",
           sum.steps_done, format_size(sum.model_state_bytes, a, sizeof(a)),
           (unsigned long long)sum.compactions);
    if (sum.pipeline_ahead)
        printf("#   the optimizer read %llu sets ahead (%llu of its sets were read again alone, "
               "finding no room beside the others)\n",
               (unsigned long long)sum.pipeline_ahead, (unsigned long long)sum.pipeline_refetched);
    /* Where the time blocked in fetch went: the largest of the four, named. */
    static const char *const stall_names[4] = {"NVMe reads", "copies between host and device",
                                               "room (write-backs before evictions)",
                                               "pins (a copy held or read by another)"};
    static const char *const stall_keys[4] = {"nvme", "copy", "room", "pin"};
    int most = 0;
    for (int k = 1; k < 4; k++)
        if (blocked_s[1 + k] > blocked_s[1 + most]) most = k;
    if (ran)
        printf("#   ran %d steps in %.1f s: %.0f tokens/s on average\n", ran, ran_seconds,
               mean_tps);
    if (ran && blocked_s[0] > 0)
        printf("#   blocked in fetch %.3f s (%.1f%%): mostly waiting for %s, %.3f s (nvme %.3f, "
               "copy %.3f, room %.3f, pin %.3f)\n",
               blocked_s[0], blocked_s[0] / ran_seconds * 100, stall_names[most],
               blocked_s[1 + most], blocked_s[1], blocked_s[2], blocked_s[3], blocked_s[4]);
    if (!strcmp(sum.precision, "fp16"))
        printf("#   fp16: %lld steps skipped for overflowed gradients; loss scale now %.9g\n",
               (long long)sum.skipped_steps, sum.loss_scale);
    for (int i = 0; i < 2; i++)
        printf("#   %-6s peak %12s of budget %12s\n", tier_names[i],
               format_size(sum.tier[i].peak_bytes, a, sizeof(a)),
               format_size(sum.tier[i].budget_bytes, b, sizeof(b)));
    printf("#   %-6s peak %12s in swap files of %12s\n", tier_names[2],
           format_size(sum.tier[2].peak_bytes, a, sizeof(a)),
           format_size(sum.tier[2].budget_bytes, b, sizeof(b)));
    if (sum.world > 1)
        printf("#   ZeRO stage %d: rank %d of %d holds the tiers above; %s came in through "
               "%llu collectives (%llu of them one copy, in the ranks' pool); the steps waited "
               "%.3f s for gradient reductions (%s)\n",
               sum.stage, sum.rank, sum.world, format_size(sum.comm_bytes, a, sizeof(a)),
               (unsigned long long)sum.comm_ops, (unsigned long long)sum.comm_pooled_ops,
               sum.reduce_seconds,
               sum.overlap_comm ? "overlap_comm: each behind the next block's backward"
                                : "each after its block's backward");
    if (log) {
        fprintf(log,
                "{\"summary\":{\"steps\":%d,\"model_state_bytes\":%llu,\"params\":%llu,"
                "\"backend\":\"%s\",\"precision\":\"%s\",\"backend_work_bytes\":%llu,"
                "\"device_scratch_bytes\":%llu,"
                "\"checkpoint_step\":%d,\"interrupted\":%s,\"failed\":%s,\"compactions\":%llu,"
                "\"min_device_bytes\":%llu,\"min_host_bytes\":%llu,\"steps_run\":%d,"
                "\"skipped_steps\":%lld,\"pipeline_ahead\":%llu,\"pipeline_refetched\":%llu",
                sum.steps_done, (unsigned long long)sum.model_state_bytes,
                (unsigned long long)sum.param_count, sum.backend, sum.precision,
                (unsigned long long)sum.backend_work_bytes,
                (unsigned long long)sum.device_scratch_bytes, sum.checkpoint_step,
                stop_requested ? "true" : "false", status != 0 && status < 128 ? "true" : "false",
                (unsigned long long)sum.compactions, (unsigned long long)sum.min_budget[0],
                (unsigned long long)sum.min_budget[1], ran, (long long)sum.skipped_steps,
                (unsigned long long)sum.pipeline_ahead, (unsigned long long)sum.pipeline_refetched);
        fprintf(log, ",\"update_in_forward\":%s", sum.update_in_forward ? "true" : "false");
        json_num(log, "train_seconds", ran_seconds, false);
        json_num(log, "mean_tokens_per_s", mean_tps, false);
        json_num(log, "loss_scale", sum.loss_scale, false);
        for (int i = 0; i < 3; i++)
            fprintf(log, ",\"%s\":{\"peak_bytes\":%llu,\"%s\":%llu}", tier_names[i],
                    (unsigned long long)sum.tier[i].peak_bytes,
                    i == 2 ? "swap_file_bytes" : "budget_bytes",
                    (unsigned long long)sum.tier[i].budget_bytes);
        fprintf(log, ",\"staging_bytes\":%llu", (unsigned long long)sum.staging_bytes);
        fprintf(log, ",\"rank\":%d,\"world\":%d,\"zero_stage\":%d,\"comm_bytes\":%llu", sum.rank,
                sum.world, sum.stage, (unsigned long long)sum.comm_bytes);
        fprintf(log, ",\"comm_ops\":%llu,\"comm_pooled_ops\":%llu",
                (unsigned long long)sum.comm_ops, (unsigned long long)sum.comm_pooled_ops);
        fprintf(log, ",\"overlap_comm\":%s", sum.overlap_comm ? "true" : "false");
        json_num(log, "reduce_seconds", sum.reduce_seconds, false);
        static const char *const blocked_keys[5] = {
            "blocked_seconds", "blocked_nvme_seconds", "blocked_copy_seconds",
            "blocked_room_seconds", "blocked_pin_seconds"};
        for (int i = 0; i < 5; i++)
            json_num(log, blocked_keys[i], blocked_s[i], false);
        fprintf(log, ",\"largest_stall\":%s", blocked_s[0] > 0 ? "\"" : "null");
        if (blocked_s[0] > 0) fprintf(log, "%s\"", stall_keys[most]);
        fprintf(log, "}}\n");
        fclose(log);
    }
    trainer_close(t);
    if (trace_path) {
        if ((r = trace_stop()) < 0) {
            fprintf(stderr, "zinf train: --trace %s: %s\n", trace_path, strerror(-r));
            if (!status) status = 1;
        } else {
            printf("# trace: %s (open it in ui.perfetto.dev or chrome://tracing)\n", trace_path);
        }
    }
    return status;
}
