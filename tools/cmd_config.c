/*
 * cmd_config.c - `zinf config check FILE [--strict] [--ranks N]`: read a DeepSpeed-style JSON
 * config the way the engine will, and print every effective setting (defaults included), the
 * engine options derived from them and the keys that were ignored or unknown.
 *
 * It checks the file, not the machine: whether the NVMe directories exist or the GPU is
 * there is left to the commands that use them (the budgets train would derive, from the RAM
 * available, are the one figure read from the machine). What the file means for `zinf train` is
 * decided by train_config_apply(), which train calls too, for the model and run that train's
 * options name (--layers, --dim, ..., taken here as train takes them); its budgets are judged
 * by trainer_plan_check(), as train judges them when it opens: a config train refuses is
 * refused here, with the same message and exit status 2.
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
#include "train/trainer.h"
#include "train_config.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf config check FILE [--strict] [--ranks N] [MODEL OPTIONS]\n"
               "\n"
               "Read a DeepSpeed-style JSON config (FILE, or - for standard input) and print\n"
               "the effective settings, defaults included, and the engine options they give.\n"
               "\n"
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
 * memfd holding its bytes. A GPU the machine lacks is left to train (the file is checked). */
static int check_budgets(const char *path, bool from_stdin, const char *text, size_t len,
                         struct trainer_opts *o, char *err, size_t errlen)
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
    struct trainer_plan pl;
    o->config_path = path;
    r = trainer_plan(o, &pl, err, errlen);
    if (r == 0)
        r = trainer_plan_check(&pl, err, errlen);
    else if (r == -ENODEV)
        r = 0; /* no GPU here, or no CUDA in this build: the machine's, not the file's */
    if (r < 0 && !err[0]) snprintf(err, errlen, "%s", strerror(-r));
    if (r == -ENOMEM) r = 1;
    o->config_path = NULL;
    if (fd >= 0) close(fd);
    return r;
}

static int check(const char *file, bool strict, struct trainer_opts *model, unsigned given)
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
    /* The settings as the file gives them ("auto" as "auto"), kept until the file is known
     * to be good. */
    char *settings = NULL;
    size_t settings_len = 0;
    FILE *mem = open_memstream(&settings, &settings_len);
    int pr = mem ? config_print(&c, mem) : -ENOMEM;
    if (mem && fclose(mem) != 0) pr = -ENOMEM;
    /* What zinf train makes of it with these options (its defaults where none is given, at
     * that many ranks): refused here for whatever reason it refuses there, in the same
     * words; the budgets too, as train judges them once the engine would open. */
    struct trainer_opts oo = *model, *o = &oo;
    struct train_config_applied ds = {0};
    int ranks = o->world;
    if (train_config_apply(&c, o, given, &ds, err, sizeof(err)) < 0 ||
        (ret = check_budgets(path, from_stdin, text, text_len, o, err, sizeof(err))) < 0) {
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
    printf("# zinf config check %s\n", file);
    if (settings) fwrite(settings, 1, settings_len, stdout);
    free(settings);
    printf("# zinf train would run: %d layers, dim %d, %d heads, seq %d, batch %d x %d "
           "accumulated%s, %d steps, %s lr %g (%s schedule)\n",
           o->model.L, o->model.C, o->model.NH, o->seq, o->batch, o->grad_accum,
           ranks > 1 ? " on each rank" : "", o->steps, ds.optimizer, o->lr, ds.scheduler);
    /* The budgets zinf train derives where the config gives none, from this machine's RAM
     * now (trainer_derive_budgets, which train calls too). */
    struct trainer_budgets bud;
    trainer_derive_budgets(o, &c, false, &bud);
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
    if (ds.autos[0]) {
        printf("# \"auto\" as zinf train resolves it with these (its options change them):\n");
        for (char *p = ds.autos, *nl; p; p = nl ? nl + 1 : NULL) {
            nl = strchr(p, '\n');
            if (nl)
                *nl = '\0';
            printf("#   %s\n", p);
        }
    }
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
    bool strict = false;
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
    return check(file, strict, &o, given);
}
