/*
 * cmd_config.c - `zinf config check FILE [--all] [--strict] [--ranks N]`: read a DeepSpeed-style
 * JSON config the way the engine will, and say first what it makes the run do (the model and
 * steps, the ZeRO stage, the precision, the optimizer and schedule, where the parameters and
 * optimizer states live, the budgets, the batch arithmetic, what each "auto" became), then the
 * keys that were ignored or unknown; with --all, every setting (defaults included) and the
 * engine options derived from them.
 *
 * It checks the file, not the machine: whether the NVMe directories exist or the GPU is
 * there is left to the commands that use them (the budgets train would derive, from the RAM
 * available, are the one figure read from the machine). What the file means for `zinf train` is
 * decided by train_config_apply(), which train calls too, for the model and run that train's
 * options name (--layers, --dim, ..., taken here as train takes them); its budgets are judged
 * by trainer_plan_check(), as train judges them when it opens: a config train refuses is
 * refused here, with the same message and exit status 2, before anything else is said.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "cmd.h"
#include "train/train_config.h"
#include "train_options.h"
#include "train/trainer.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf config check FILE [--all] [--strict] [--ranks N] [MODEL OPTIONS]\n"
               "\n"
               "Read a DeepSpeed-style JSON config (FILE, or - for standard input) and say what\n"
               "it makes zinf train do: the model and steps, the ZeRO stage, the precision, the\n"
               "optimizer and schedule, where the parameters and optimizer states live, the\n"
               "budgets, the batch, what each \"auto\" became; then the keys zinf ignores.\n"
               "\n"
               "  --all      then every setting, defaults included, and the engine options\n"
               "  --strict   treat unknown keys as errors (exit 2)\n"
               "  --ranks N  check it for a job of N ranks (zinf launch -n N), 1-64; default:\n"
               "             WORLD_SIZE where zinf launch set it, else 1\n"
               "  --layers N, --dim N, --heads N, --seq N, --batch N, --accumulate N,\n"
               "  --precision P, --steps N, --lr X, --weight-decay X, --clip X, --seed N,\n"
               "  --sample-every N\n"
               "             the model and run to check it for, as zinf train takes them\n"
               "             (default: train's defaults and the config's zinf.train section)\n"
               "\n"
               "Exit status: 0 valid; 1 the settings could not be written out; 2 a bad file\n"
               "(it names the JSON path and what is wrong), a config zinf train refuses\n"
               "(for that model, at that many ranks: budgets too small included), unknown\n"
               "keys with --strict, or bad usage.\n");
}

/* All of fd's bytes into *buf (NUL-terminated; free it), *len of them: 0 or -errno. */
static int read_all(int fd, char **buf, size_t *len)
{
    size_t cap = 0;
    *buf = NULL;
    *len = 0;
    for (;;) {
        if (*len + 1 >= cap) {
            char *nb = cap < 64 * MiB ? realloc(*buf, cap ? cap * 2 : 64 * KiB) : NULL;
            if (!nb) {
                free(*buf);
                *buf = NULL;
                return cap < 64 * MiB ? -ENOMEM : -EFBIG;
            }
            *buf = nb;
            cap = cap ? cap * 2 : 64 * KiB;
        }
        ssize_t n = read(fd, *buf + *len, cap - *len - 1);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            int r = -errno;
            free(*buf);
            *buf = NULL;
            return r;
        }
        if (n == 0) break;
        *len += (size_t)n;
    }
    (*buf)[*len] = '\0';
    return 0;
}

/* The plan's budget check (trainer_plan, trainer_plan_check) of the options o, for the
 * config in text (len bytes) that the file at path holds: 0, 1 where it cannot be made, or
 * -EINVAL with train's refusal in err. Standard input, read once already, is handed over as a
 * memfd holding its bytes. A GPU the machine lacks is left to train (the file is checked).
 * The plan goes to *pl, *planned saying whether one was made. */
static int check_budgets(const char *path, bool from_stdin, const char *text, size_t len,
                         struct trainer_opts *o, struct trainer_plan *pl, bool *planned,
                         char *err, size_t errlen)
{
    char fdpath[64];
    int fd = -1, r;
    if (from_stdin) {
        fd = memfd_create("zinf-config", MFD_CLOEXEC);
        if (fd < 0) {
            snprintf(err, errlen, "a copy of standard input: %s", strerror(errno));
            return 1;
        }
        for (size_t at = 0; at < len;) {
            ssize_t k = write(fd, text + at, len - at);
            if (k < 0 && errno == EINTR) continue;
            if (k < 0) {
                snprintf(err, errlen, "a copy of standard input: %s", strerror(errno));
                close(fd);
                return 1;
            }
            at += (size_t)k;
        }
        snprintf(fdpath, sizeof(fdpath), "/proc/self/fd/%d", fd);
        path = fdpath;
    }
    o->config_path = path;
    r = trainer_plan(o, pl, err, errlen);
    *planned = r == 0;
    if (r == 0)
        r = trainer_plan_check(pl, err, errlen);
    else if (r == -ENODEV)
        r = 0; /* no GPU here, or no CUDA in this build: the machine's, not the file's */
    if (r < 0 && !err[0]) snprintf(err, errlen, "%s", strerror(-r));
    if (r == -ENOMEM) r = 1;
    o->config_path = NULL;
    if (fd >= 0) close(fd);
    return r;
}

/* ---- what the config makes the run do ------------------------------------------------ */

/* What a rank keeps 1/N of, at ZeRO stage `stage` across N ranks (stage 0 runs as 1). */
static const char *partitioned(int stage)
{
    return stage >= 3   ? "the optimizer states, gradients and parameters"
           : stage == 2 ? "the optimizer states and gradients"
                        : "the optimizer states";
}

static void say_stage(const struct zinf_config *c, int ranks)
{
    int st = c->zero.stage;
    const char *given = config_given(c, "zero_optimization.stage") ? "" : " (not given)";
    if (ranks <= 1) {
        printf("# ZeRO stage %d%s, one rank: it holds its whole partition, every tensor; "
               "zinf launch -n N would give each rank 1/N of %s%s\n",
               st, given, partitioned(st), st == 0 ? " (stage 0 runs as 1 across ranks)" : "");
        return;
    }
    printf("# ZeRO stage %d%s over %d ranks: each keeps 1/%d of %s%s%s\n", st, given, ranks, ranks,
           partitioned(st),
           st >= 3   ? " (each block's parameters gathered whole as it computes)"
           : st == 2 ? ", and the parameters whole"
                     : ", and the gradients and parameters whole",
           st == 0 ? " (stage 0 runs as 1 across ranks)" : "");
}

/* Whether the device computes with 16-bit weights apart from the fp32 master weights. */
static bool sixteen_bit(const struct trainer_opts *o, bool cuda)
{
    return o->precision == TRAINER_PRECISION_BF16 || o->precision == TRAINER_PRECISION_FP16 ||
           (o->precision == TRAINER_PRECISION_AUTO && cuda);
}

static void say_precision(const struct trainer_opts *o, bool planned, bool cuda)
{
    const char *what = "fp32 weights and activations";
    char why[128] = "";
    enum trainer_precision p = o->precision;
    if (p == TRAINER_PRECISION_AUTO) {
        /* As the trainer decides it: bf16 where a GPU computes, fp32 on the CPU. */
        if (!planned) {
            printf("# precision: bf16 on a GPU, fp32 on the CPU (zinf.train.precision \"auto\"); "
                   "no loss scaling\n");
            return;
        }
        p = cuda ? TRAINER_PRECISION_BF16 : TRAINER_PRECISION_FP32;
        snprintf(why, sizeof(why), " (\"auto\": %s)",
                 cuda ? "bf16 where a GPU computes" : "fp32 on the CPU, bf16 on a GPU");
    }
    if (p == TRAINER_PRECISION_BF16)
        what = "bf16 weights on the device, fp32 master weights";
    else if (p == TRAINER_PRECISION_FP16)
        what = "fp16 weights on the device, fp32 master weights";
    if (p != TRAINER_PRECISION_FP16) {
        printf("# precision: %s%s; no loss scaling\n", what, why);
        return;
    }
    const struct trainer_fp16 *f = &o->fp16;
    if (f->loss_scale > 0)
        printf("# precision: %s%s; a static loss scale of %g (fp16.loss_scale)\n", what, why,
               f->loss_scale);
    else
        printf("# precision: %s%s; DeepSpeed's dynamic loss scaling from 2^%d (window %d, "
               "hysteresis %d%s, at least %g)\n",
               what, why, f->initial_scale_power, f->loss_scale_window, f->hysteresis,
               f->consecutive_hysteresis ? ", consecutive" : "", f->min_loss_scale);
}

static void say_optimizer(const struct trainer_opts *o, const struct train_config_applied *ds)
{
    char clip[48] = "no gradient clipping", extra[160] = "";
    if (o->grad_clip > 0)
        snprintf(clip, sizeof(clip), "gradients clipped to norm %g", o->grad_clip);
    if (o->optimizer == TRAINER_OPT_LAMB)
        snprintf(extra, sizeof(extra), ", trust ratio in [%g, %g]", o->lamb_min_coeff,
                 o->lamb_max_coeff);
    if (o->state_dtype == 1)
        snprintf(extra + strlen(extra), sizeof(extra) - strlen(extra),
                 ", Adam's m and v in bf16 (stochastic rounding)");
    else if (o->state_dtype == 2)
        snprintf(extra + strlen(extra), sizeof(extra) - strlen(extra),
                 ", Adam's m and v in 8 bits (blockwise, as bitsandbytes' 8-bit Adam)");
    printf("# optimizer: %s, lr %g, betas %g %g, eps %g, weight decay %g%s%s, %s\n", ds->optimizer,
           o->lr, o->beta1, o->beta2, o->eps, o->weight_decay, extra,
           o->no_bias_correction ? ", no bias correction" : "", clip);

    const struct trainer_lr_schedule *s = &o->sched;
    const char *warm = s->linear ? "linearly" : "logarithmically";
    int W = MAX(2, s->warmup_steps); /* as DeepSpeed takes it */
    char how[256];
    switch (s->type) {
    case TRAINER_SCHED_WARMUP:
        snprintf(how, sizeof(how), "WarmupLR: from %g up to %g %s over %d steps, then constant",
                 s->min_lr, s->max_lr, warm, W);
        break;
    case TRAINER_SCHED_WARMUP_DECAY:
        snprintf(how, sizeof(how),
                 "WarmupDecayLR: from %g up to %g %s over %d steps, then linearly down to %g at "
                 "step %d",
                 s->min_lr, s->max_lr, warm, W, s->min_lr, s->total_steps);
        break;
    case TRAINER_SCHED_WARMUP_COSINE:
        snprintf(how, sizeof(how),
                 "WarmupCosineLR: from %g x lr up to lr %s over %d steps, then a cosine down to "
                 "%g x lr at step %d",
                 s->min_ratio, warm, W, s->cos_min_ratio, s->total_steps);
        break;
    case TRAINER_SCHED_LR_RANGE:
        snprintf(how, sizeof(how), "LRRangeTest: from %g, growing by %g x that every %d steps%s",
                 s->range_min_lr, s->range_rate, s->range_size,
                 s->range_staircase ? " in stairs" : "");
        break;
    case TRAINER_SCHED_ONE_CYCLE:
        snprintf(how, sizeof(how), "OneCycle: from %g up to %g over %g steps and back over %g%s",
                 s->cycle_min_lr, s->cycle_max_lr, s->cycle_first_size,
                 s->cycle_second_size < 0 ? s->cycle_first_size : s->cycle_second_size,
                 s->cycle_momentum ? ", the momentum the other way" : "");
        break;
    default:
        snprintf(how, sizeof(how), "constant lr");
    }
    printf("# schedule: %s; lr %g at step 1, %g at step %d (the last)\n", how,
           trainer_lr_at(s, o->lr, 1), trainer_lr_at(s, o->lr, MAX(o->steps, 1)), MAX(o->steps, 1));
}

static const char *where(enum config_offload_device d)
{
    return d == CONFIG_OFFLOAD_NVME  ? "on NVMe"
           : d == CONFIG_OFFLOAD_CPU ? "in host memory"
                                     : "on the device";
}

static const char *device_name(enum config_offload_device d)
{
    return d == CONFIG_OFFLOAD_NVME ? "nvme" : d == CONFIG_OFFLOAD_CPU ? "cpu" : "none";
}

static void say_placement(const struct zinf_config *c, const struct trainer_opts *o, bool cuda)
{
    const struct config_offload_param *op = &c->zero.offload_param;
    const struct config_offload_optimizer *oo = &c->zero.offload_optimizer;
    char persist[128] = "";
    if (op->device != CONFIG_OFFLOAD_NONE && c->zero.stage3_param_persistence_threshold &&
        config_given(c, "zero_optimization.stage3_param_persistence_threshold"))
        snprintf(persist, sizeof(persist),
                 "; those under %llu elements homed on the device "
                 "(stage3_param_persistence_threshold)",
                 (unsigned long long)c->zero.stage3_param_persistence_threshold);
    printf("# parameters: %s (offload_param.device \"%s\")%s\n", where(op->device),
           device_name(op->device), persist);
    printf("# optimizer states (Adam's moments%s): %s (offload_optimizer.device \"%s\"), "
           "updated %s\n",
           sixteen_bit(o, cuda) ? " and the fp32 master weights" : "", where(oo->device),
           device_name(oo->device),
           oo->device == CONFIG_OFFLOAD_NONE ? "on the device" : "on the host");
    char a[32];
    printf("# NVMe: ");
    for (unsigned i = 0; i < c->nvme_paths.count; i++)
        printf("%s%s", i ? ", " : "", c->nvme_paths.path[i]);
    if (c->nvme_paths.count)
        printf(" (%s blocks, queue depth %u)", format_size(c->aio.block_size, a, sizeof(a)),
               c->aio.queue_depth);
    else
        printf("none%s",
               c->zinf.connect.count ? " here: the daemon's job keeps the swap files" : "");
    /* pin_memory is about what is offloaded: with nothing offloaded it says nothing. */
    if (op->device != CONFIG_OFFLOAD_NONE || oo->device != CONFIG_OFFLOAD_NONE) {
        bool pin = op->pin_memory || oo->pin_memory;
        bool said = config_given(c, "zero_optimization.offload_param.pin_memory") ||
                    config_given(c, "zero_optimization.offload_optimizer.pin_memory");
        printf("; the host tier %s (pin_memory %s)", pin ? "pinned" : "unpinned",
               pin ? "true" : said ? "false" : "not given");
    }
    printf("\n");
    if (c->zinf.connect.count)
        printf("# through the daemon at %s (zinf.connect), job %s: its tiers and budgets\n",
               c->zinf.connect.path[0], c->zinf.job[0] ? c->zinf.job : "the default");
}

/* One tier's budget: the config's, derived (said below), or the engine's own (a GPU's). */
static const char *budget(const struct zinf_config *c, bool device, const struct trainer_budgets *b,
                          char *buf, size_t len)
{
    char a[32];
    uint64_t given = device ? c->zinf.device_bytes : c->zinf.host_bytes;
    if (given)
        snprintf(buf, len, "%s (zinf.%s_bytes)", format_size(given, a, sizeof(a)),
                 device ? "device" : "host");
    else if (device ? b->device_how[0] : b->host_how[0])
        snprintf(buf, len, "%s (derived, below)",
                 format_size(device ? b->device : b->host, a, sizeof(a)));
    else
        snprintf(buf, len, "%s", device ? "the GPU's free memory at open less 1 GiB"
                                        : "the engine's default, 1 GiB");
    return buf;
}

static void say_budgets(const struct zinf_config *c, const struct trainer_budgets *b,
                        const struct trainer_plan *pl, bool planned)
{
    char d[96], h[96], a[32], e[32];
    printf("# budgets: device %s, host %s", budget(c, true, b, d, sizeof(d)),
           budget(c, false, b, h, sizeof(h)));
    if (planned)
        printf("; the least with which every step runs: %s, %s",
               format_size(pl->min_budget[0], a, sizeof(a)),
               format_size(pl->min_budget[1], e, sizeof(e)));
    printf("\n");
}

static void say_batch(const struct zinf_config *c, const struct trainer_opts *o, int ranks,
                      bool batch_auto)
{
    uint64_t global = (uint64_t)o->batch * o->grad_accum * ranks;
    printf("# batch: micro-batch %d x %d accumulation step%s x %d rank%s = %llu sequences of %d "
           "tokens a step (train_batch_size %s)\n",
           o->batch, o->grad_accum, o->grad_accum == 1 ? "" : "s", ranks, ranks == 1 ? "" : "s",
           (unsigned long long)global, o->seq,
           !config_given(c, "train_batch_size") ? "not given"
           : batch_auto                          ? "\"auto\""
                                                 : "given");
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

static int check(const char *file, bool strict, bool all, struct trainer_opts *model,
                 unsigned given)
{
    struct zinf_config c;
    char err[2048];
    bool from_stdin = !strcmp(file, "-");
    const char *path = from_stdin ? "/dev/stdin" : file;
    size_t flen = strlen(path);
    char *text = NULL;
    size_t text_len = 0;
    int ret;

    /* Standard input is read once, and its bytes kept for the budget check. */
    if (from_stdin && (ret = read_all(STDIN_FILENO, &text, &text_len)) < 0) {
        fprintf(stderr, "zinf: %s: %s\n", path,
                ret == -EFBIG ? "file too large for a config (more than 64 MiB)" : strerror(-ret));
        return 2;
    }
    ret = from_stdin ? config_parse_buffer(text, text_len, path, &c, err, sizeof(err))
                     : config_parse_file(path, &c, err, sizeof(err));
    if (ret < 0) {
        /* File and syntax errors already start with the file's name. */
        if (!strncmp(err, path, flen) && err[flen] == ':')
            fprintf(stderr, "zinf: %s\n", err);
        else
            fprintf(stderr, "zinf: %s: %s\n", path, err);
        config_free(&c);
        free(text);
        return 2;
    }
    /* With --all, the settings as the file gives them ("auto" as "auto"), kept until the file
     * is known to be good. */
    char *settings = NULL;
    size_t settings_len = 0;
    int pr = 0;
    if (all) {
        FILE *mem = open_memstream(&settings, &settings_len);
        pr = mem ? config_print_settings(&c, mem) : -ENOMEM;
        if (mem && fclose(mem) != 0) pr = -ENOMEM;
    }
    /* What zinf train makes of it with these options (its defaults where none is given, at
     * that many ranks): refused here for whatever reason it refuses there, in the same
     * words; the budgets too, as train judges them once the engine would open. */
    struct trainer_opts oo = *model, *o = &oo;
    struct train_config_applied ds = {0};
    struct trainer_plan pl;
    bool planned = false;
    int ranks = o->world;
    bool batch_auto = config_is_auto(&c, "train_batch_size"); /* before it is resolved */
    if (train_config_apply(&c, o, given, &ds, err, sizeof(err)) < 0 ||
        (ret = check_budgets(path, from_stdin, text, text_len, o, &pl, &planned, err,
                             sizeof(err))) < 0) {
        fprintf(stderr, "zinf: %s: %s\n", path, err);
        free(settings);
        free(text);
        config_free(&c);
        return 2;
    }
    free(text);
    if (ret > 0) {
        fprintf(stderr, "zinf: config check: could not judge the budgets: %s\n", err);
        free(settings);
        config_free(&c);
        return 1;
    }

    /* First the verdict, then what the run does. */
    printf("# zinf config check %s\n", file);
    size_t n_ignored = 0;
    for (const char *p = ds.ignored; *p; p++)
        n_ignored += *p == '\n' || !p[1];
    if (strict && c.n_unknown)
        printf("# verdict: refused (--strict): %zu unknown key%s, listed below\n", c.n_unknown,
               c.n_unknown == 1 ? "" : "s");
    else if (n_ignored || c.n_unknown)
        printf("# verdict: valid for zinf train at %d rank%s; %zu key%s ignored and %zu unknown, "
               "listed below\n", ranks, ranks == 1 ? "" : "s", n_ignored,
               n_ignored == 1 ? "" : "s", c.n_unknown);
    else
        printf("# verdict: valid for zinf train at %d rank%s; zinf acts on every key\n", ranks,
               ranks == 1 ? "" : "s");
    printf("# zinf train would run: %d layers, dim %d, %d heads, seq %d, batch %d x %d "
           "accumulated%s, %d steps, %s lr %g (%s schedule)\n",
           o->model.L, o->model.C, o->model.NH, o->seq, o->batch, o->grad_accum,
           ranks > 1 ? " on each rank" : "", o->steps, ds.optimizer, o->lr, ds.scheduler);
    say_stage(&c, ranks);
    say_precision(o, planned, planned && pl.cuda);
    say_optimizer(o, &ds);
    say_placement(&c, o, planned && pl.cuda);
    /* The budgets zinf train derives where the config gives none, from this machine's RAM
     * now (trainer_derive_budgets, which train calls too). */
    struct trainer_budgets bud;
    trainer_derive_budgets(o, &c, false, &bud);
    say_budgets(&c, &bud, &pl, planned);
    if (bud.device_how[0] || bud.host_how[0]) {
        char a[32];
        printf("# zinf train's budgets where the config gives none (zinf.device_bytes, "
               "zinf.host_bytes), for this model:\n");
        if (bud.device_how[0])
            printf("#   device %s: %s%s\n", format_size(bud.device, a, sizeof(a)),
                   bud.device_how,
                   c.zinf.device != ZINF_DEVICE_EMULATED
                       ? "; on a GPU, the engine's: its free memory at open less 1 GiB"
                       : "");
        if (bud.host_how[0])
            printf("#   host %s: %s\n", format_size(bud.host, a, sizeof(a)), bud.host_how);
    }
    say_batch(&c, o, ranks, batch_auto);
    if (ds.autos[0]) {
        printf("# \"auto\" as zinf train resolves it with these (its options change them):\n");
        print_lines("#   ", ds.autos);
    }

    /* Then what it asks for that zinf does not do, once each, with why (what ZeRO says across
     * ranks counts at --ranks N, as in zinf train). */
    if (ds.ignored[0]) {
        printf("# ignored by zinf (DeepSpeed keys zinf does not act on):\n");
        print_lines("#   ", ds.ignored);
    }
    if (c.n_unknown) {
        printf("# unknown keys (ignored):\n");
        for (size_t i = 0; i < c.n_unknown; i++)
            printf("#   %s\n", c.unknown[i]);
    }

    /* Last, with --all, every setting and the engine options. */
    if (all) {
        printf("# every setting, defaults included (--all):\n");
        if (settings) fwrite(settings, 1, settings_len, stdout);
    }
    free(settings);
    if (pr < 0 || fflush(stdout) != 0) {
        fprintf(stderr, "zinf: config check: could not write the settings\n");
        config_free(&c);
        return 1;
    }
    ret = 0;
    if (strict && c.n_unknown) {
        fprintf(stderr, "zinf: %s: %zu unknown key%s (--strict)\n", path, c.n_unknown,
                c.n_unknown == 1 ? "" : "s");
        ret = 2;
    }
    config_free(&c);
    return ret;
}

/* s as a number of ranks, 1..64; 0 if it is not one. */
static int ranks_of(const char *s)
{
    char *end;
    long v = strtol(s, &end, 10);
    return *s && !*end && v >= 1 && v <= 64 ? (int)v : 0;
}

/* The option a (without its "--") among train_shape_options: its value, or 0. */
static int shape_option(const char *a)
{
    for (size_t k = 0; train_shape_options[k].name; k++)
        if (!strcmp(a, train_shape_options[k].name)) return train_shape_options[k].val;
    return 0;
}

int cmd_config(int argc, char **argv)
{
    const char *file = NULL;
    bool strict = false, all = false;
    int ranks = 0; /* 0: not given */
    struct trainer_opts o;
    unsigned given = 0; /* as zinf train's: bit (option - O_LAYERS) of each option given */
    char err[256];

    trainer_opts_defaults(&o);
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
                      !strcmp(argv[1], "help"))) {
        usage(stdout);
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "check")) {
        if (argc >= 2)
            fprintf(stderr, "zinf: config: unknown subcommand '%s'\n", argv[1]);
        usage(stderr);
        return 2;
    }
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        int opt = !strncmp(a, "--", 2) ? shape_option(a + 2) : 0;
        if (opt) {
            /* The model and the run, as zinf train takes them. */
            const char *v = ++i < argc ? argv[i] : "";
            if (train_option_apply(opt, v, &o, &given, err, sizeof(err)) < 0) {
                fprintf(stderr, "zinf: config check: %s\n", err);
                return 2;
            }
        } else if (!strcmp(a, "--sample-every")) {
            /* Sampling's set counts in the host budget: only whether it is on matters. */
            const char *v = ++i < argc ? argv[i] : "";
            char *end;
            long n = strtol(v, &end, 10);
            if (!*v || *end || n < 0 || n > 100000000) {
                fprintf(stderr,
                        "zinf: config check: --sample-every: expected an integer in "
                        "0..100000000, got '%s'\n",
                        v);
                return 2;
            }
            o.sample = n > 0;
        } else if (!strcmp(a, "--strict")) {
            strict = true;
        } else if (!strcmp(a, "--all")) {
            all = true;
        } else if (!strcmp(a, "--ranks")) {
            const char *v = ++i < argc ? argv[i] : "";
            if ((ranks = ranks_of(v)) == 0) {
                fprintf(stderr, "zinf: config check: --ranks: a number of ranks in 1..64, got "
                                "'%s'\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "zinf: config check: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        } else if (file) {
            fprintf(stderr, "zinf: config check: one FILE only, got '%s' and '%s'\n", file, a);
            return 2;
        } else {
            file = a;
        }
    }
    if (!file) {
        fprintf(stderr, "zinf: config check: FILE is missing\n");
        usage(stderr);
        return 2;
    }
    /* Under zinf launch, the job's size; --ranks says otherwise. */
    const char *ws = getenv("WORLD_SIZE");
    if (!ranks && ws && *ws && (ranks = ranks_of(ws)) == 0) {
        fprintf(stderr, "zinf: config check: WORLD_SIZE '%s' is not a number of ranks in 1..64\n",
                ws);
        return 2;
    }
    o.world = ranks ? ranks : 1;
    return check(file, strict, all, &o, given);
}
