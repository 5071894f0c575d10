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
 *
 * This file is the command's flow: the run opened, stepped, checkpointed, evaluated, sampled,
 * exported and closed, and its signals. The command line and the config are
 * cmd_train_opts.c's; the settings, the step lines and the summary, printed and logged, are
 * cmd_train_report.c's (cmd_train.h is what they share).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "cmd.h"
#include "cmd_train.h"
#include "common.h"
#include "engine/engine.h"
#include "progress.h"
#include "trace.h"
#include "train/gpt.h"
#include "train/trainer.h"
#include "train/weights.h"
#include "zinf.h"

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
    const struct trainer_opts *o; /* LoRA: the adapters are merged in */
    const struct gpt_tensor_desc *d;
};

static int read_param(void *ctx, int idx, float *dst)
{
    const struct param_reader *pr = ctx;
    zinf_engine *e = trainer_param_engine(pr->t, idx);
    char name[64];
    zinf_tensor h;
    snprintf(name, sizeof(name), "p.%s", pr->d[idx].name);
    int r = zinf_lookup(e, name, &h);
    if (r == 0) r = zinf_read(e, h, 0, dst, pr->d[idx].numel * sizeof(float));
    return r < 0 ? r : cmd_train_lora_merge(pr->t, pr->o, &pr->d[idx], dst);
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
    struct param_reader pr = {.t = t, .o = o, .d = d};
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
        cmd_train_say_kept(&sum, "");
        return r;
    }
    trainer_get_summary(t, &sum);
    printf("# checkpoint: step %d, %.1f ms, %s written\n", sum.checkpoint_step,
           sum.checkpoint_seconds * 1e3, format_size(sum.checkpoint_bytes, a, sizeof(a)));
    fflush(stdout);
    if (log) {
        fprintf(log, "{\"checkpoint\":%d", sum.checkpoint_step);
        cmd_train_json_num(log, "ms", sum.checkpoint_seconds * 1e3, false);
        fprintf(log, ",\"bytes_written\":%llu}\n", (unsigned long long)sum.checkpoint_bytes);
        fflush(log);
    }
    return 0;
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
        cmd_train_json_num(log, "val_loss", loss, true);
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
    struct train_args a;
    struct trainer *t = NULL;
    struct weights_file *init = NULL; /* --init's file, checked */
    FILE *log = NULL;
    char err[512];
    int r = cmd_train_parse(argc, argv, &a), status = 0;
    bool ckpt_failed = false;

    if (r >= 0) return r;
    /* The run's options: the command line's, and what the run adds (the log's digest, the
     * signal that stops the ranks' rendezvous, --init's source). */
    struct trainer_opts o = a.o;
    /* --init's file is checked whole against the model before anything opens, so that a
     * mismatch refuses the run having touched nothing (a dry run says it too). */
    /* Those files hold a dense GPT-2's tensors: a model with MoE blocks has others. */
    if (o.moe.E && (a.init_path || a.export_hf)) {
        fprintf(stderr,
                "zinf train: %s with --experts %d (moe.num_experts): the file holds a dense "
                "GPT-2, and a model with MoE blocks has a gate and experts in place of their "
                "MLPs (use --export FILE.safetensors for its own layout)\n",
                a.init_path ? "--init" : "--export-hf", o.moe.E);
        return 2;
    }
    if (a.init_path) {
        struct gpt_config gc = o.model;
        gc.maxT = o.seq;
        char werr[4096];
        r = weights_open(a.init_path, &gc, &init, werr, sizeof(werr));
        if (r < 0) {
            cmd_train_say_lines("--init ", werr);
            return r == -ENOMEM ? 1 : 2;
        }
    }
    if (a.dry_run) {
        /* What would run, decided as config check decides it; nothing is opened. The
         * budgets are judged as trainer_open judges them, a run they would refuse refused
         * here in its words. */
        struct trainer_plan pl;
        if ((r = trainer_plan(&o, &pl, err, sizeof(err))) < 0 ||
            (r = trainer_plan_check(&pl, err, sizeof(err))) < 0) {
            /* As zinf config check says it: the file, then what is wrong with it. */
            fprintf(stderr, "zinf train: %s: %s\n", o.config_path, err[0] ? err : zinf_strerror(r));
            weights_close(init);
            return r == -ENOMEM ? 1 : 2;
        }
        cmd_train_print_dry_run(&o, &a.ds, a.print_lr, init, a.init_path);
        weights_close(init);
        return fflush(stdout) == 0 ? 0 : 1;
    }
    /* Across ranks, rank 0 writes the log and the others LOG.rank-R beside it. */
    char rank_log[4096];
    if (a.log_path && o.rank > 0) {
        snprintf(rank_log, sizeof(rank_log), "%s.rank-%d", a.log_path, o.rank);
        a.log_path = rank_log;
    }
    /* The log carries each step's parameter digest (every rank has --log when one has:
     * they share the command line, and the digest is summed across them). */
    o.digest = a.log_path != NULL;
    /* Appending, so that a run refused below leaves an old log as it was. */
    if (a.log_path && !(log = fopen(a.log_path, "a"))) {
        fprintf(stderr, "zinf train: --log %s: %s\n", a.log_path, strerror(errno));
        weights_close(init);
        return 2;
    }

    /* The trace, before anything it shows; other ranks write FILE.rank-R. Whatever path
     * leaves from here, the file is closed at exit. */
    char rank_trace[4096];
    if (a.trace_path && o.rank > 0) {
        snprintf(rank_trace, sizeof(rank_trace), "%s.rank-%d", a.trace_path, o.rank);
        a.trace_path = rank_trace;
    }
    if (a.trace_path) {
        if ((r = trace_start(a.trace_path)) < 0) {
            fprintf(stderr, "zinf train: --trace %s: %s\n", a.trace_path,
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
        fprintf(stderr, "zinf train: --log %s: %s\n", a.log_path, strerror(errno));
        fclose(log);
        trainer_close(t);
        weights_close(init);
        return 2;
    }
    /* --export reads each weight whole: across ranks at stage 3 each holds shards. */
    struct trainer_summary es;
    trainer_get_summary(t, &es);
    /* A pipeline stage holds its blocks only: the whole model is no rank's. */
    const char *whole = a.export_path ? "--export" : a.export_hf ? "--export-hf"
                        : a.eval_every > 0 ? "--eval-every" : a.sample_every > 0 ? "--sample-every"
                                                                             : NULL;
    if ((es.pp > 1 || es.tp > 1 || es.sp > 1) && whole) {
        fprintf(stderr,
                "zinf train: %s: each of the %d %s holds its own part of the model, and %s "
                "across them is not built yet (run it without pipeline.stages, "
                "tensor_parallel and sequence_parallel_size)\n",
                whole, es.pp * es.tp * es.sp,
                es.tp * es.sp == 1 ? "pipeline stages"
                : es.pp == 1       ? (es.tp > 1 ? "tensor-parallel ranks" : "sequence-parallel ranks")
                                   : "stages' ranks",
                whole[2] == 'e' && whole[3] == 'x' ? "the export" : "the forward");
        if (log) fclose(log);
        trainer_close(t);
        weights_close(init);
        return 2;
    }
    /* MoE blocks: the held-out loss and the samples run the dense forward, and each expert-
     * parallel rank holds its own experts only. */
    const char *moe_no = a.eval_every > 0                        ? "--eval-every"
                         : a.sample_every > 0                    ? "--sample-every"
                         : a.export_path && es.world > 1 ? "--export"
                                                                 : NULL;
    if (o.moe.E && moe_no) {
        fprintf(stderr,
                "zinf train: %s with --experts %d (moe.num_experts): %s\n", moe_no, o.moe.E,
                moe_no[3] == 'x' ? "each of the ranks holds its own experts, and the export "
                                   "across them is not built yet (export on one rank: zinf "
                                   "train --resume --steps N --export FILE re-cuts the saved "
                                   "run for it)"
                                 : "the forward of the held-out loss and of the samples is "
                                   "not built for MoE blocks yet");
        if (log) fclose(log);
        trainer_close(t);
        weights_close(init);
        return 2;
    }
    if (a.export_path || a.export_hf) {
        if (es.world > 1 && es.stage >= 3) {
            fprintf(stderr,
                    "zinf train: %s: at ZeRO stage 3 each of the %d ranks holds a shard of "
                    "every weight; export on one rank (zinf train --resume --steps N %s "
                    "%s re-cuts the saved run for it) or at stage 1 or 2\n",
                    a.export_path ? "--export" : "--export-hf", es.world,
                    a.export_path ? "--export" : "--export-hf", a.export_path ? "FILE" : "DIR");
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
    cmd_train_print_start(&o, &sum, a.nvme_offload);
    if (init) {
        printf("# init: %d tensors from %s (%s), saved as step 0\n",
               4 + GPT_BLOCK_NSLOTS * o.model.L, a.init_path,
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
    cmd_train_print_head(&o, &a.ds, &sum, a.ckpt_every, a.steps_per_print, log);

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
        if (log) cmd_train_cpu_by_thread(&c0);
        getrusage(RUSAGE_SELF, &ru0);
        r = trainer_step(t, &st);
        getrusage(RUSAGE_SELF, &ru1);
        if (log) {
            c1 = c0;
            cmd_train_cpu_by_thread(&c1);
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
        if (st.step % a.steps_per_print == 0 || st.step == o.steps)
            cmd_train_print_step(&st, eta, &sum);
        /* The line before waited for its digest: an update deferred to this step's forward
         * gave it. Out first, so that a failure to make this step's line loses no more. */
        if (held.line && st.have_digest && st.digest_step == held.step)
            cmd_train_held_put(log, &held, true, st.digest);
        char *line = NULL;
        size_t line_len = 0;
        FILE *ln = log ? open_memstream(&line, &line_len) : NULL;
        if (log && !ln) {
            fprintf(stderr, "zinf train: --log: %s\n", strerror(errno));
            status = 1;
            break;
        }
        if (ln) {
            cmd_train_log_step(ln, &st, eta, &ru0, &ru1, &c0, &c1);
            fclose(ln);
            /* A line still held has no digest to wait for (its update failed, or the state
             * is torn). This one waits for its own where its update is deferred. */
            cmd_train_held_put_summary(t, log, &held);
            held = (struct held_line){.line = line, .step = st.step};
            if (!(st.update_pending && o.digest))
                cmd_train_held_put(log, &held, st.have_digest && st.digest_step == st.step,
                                   st.digest);
        }
        bool end = st.step == o.steps;
        bool evaluating = a.eval_every > 0 && (st.step % a.eval_every == 0 || end),
             sampling = a.sample_every > 0 && (st.step % a.sample_every == 0 || end),
             saving = a.ckpt_every > 0 && st.step % a.ckpt_every == 0 && st.step < o.steps;
        /* Their lines come after the step's, which its finished update completes. */
        if (held.line && (evaluating || sampling || saving)) {
            trainer_finish_update(t);
            cmd_train_held_put_summary(t, log, &held);
        }
        if (a.eval_every > 0 && (st.step % a.eval_every == 0 || end) &&
            evaluate(t, st.step, (int)a.eval_batches, log) < 0) {
            status = 1;
            break;
        }
        if (a.sample_every > 0 && (st.step % a.sample_every == 0 || end) &&
            sample(t, st.step, o.seed, a.sample_bytes, log) < 0) {
            status = 1;
            break;
        }
        if (a.ckpt_every > 0 && st.step % a.ckpt_every == 0 && st.step < o.steps) {
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
        cmd_train_held_put_summary(t, log, &held);
    }
    trainer_get_summary(t, &sum);
    if (sum.torn) {
        /* Half of the failed step's updates are in memory: the last checkpoint stays. */
        cmd_train_say_kept(&sum, " once the cause is fixed");
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
    if (exporting && a.export_path &&
        export_params(t, &o, sum.steps_done, a.export_path, false) < 0)
        status = 1;
    if (exporting && a.export_hf && export_params(t, &o, sum.steps_done, a.export_hf, true) < 0)
        status = 1;
    if (exporting && a.export_lora &&
        cmd_train_export_lora(t, &o, sum.steps_done, a.export_lora, a.init_path) < 0)
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
    cmd_train_print_summary(&o, &sum, ran, ran_seconds, blocked_s, stop_requested != 0, status,
                            log);
    if (log) fclose(log);
    trainer_close(t);
    if (a.trace_path) {
        if ((r = trace_stop()) < 0) {
            fprintf(stderr, "zinf train: --trace %s: %s\n", a.trace_path, strerror(-r));
            if (!status) status = 1;
        } else {
            printf("# trace: %s (open it in ui.perfetto.dev or chrome://tracing)\n", a.trace_path);
        }
    }
    return status;
}
