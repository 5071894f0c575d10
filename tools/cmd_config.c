/*
 * cmd_config.c - `zinf config check FILE [--strict] [--ranks N]`: read a DeepSpeed-style JSON
 * config the way the engine will, and print every effective setting (defaults included), the
 * engine options derived from them and the keys that were ignored or unknown.
 *
 * It checks the file, not the machine: whether the NVMe directories exist or the GPU is
 * there is left to the commands that use them (the budgets train would derive, from the RAM
 * available, are the one figure read from the machine). What the file means for `zinf train` is
 * decided by train_config_apply(), which train calls too: a config train refuses is refused
 * here, with the same message and exit status 2.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "cmd.h"
#include "train/trainer.h"
#include "train_config.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf config check FILE [--strict] [--ranks N]\n"
               "\n"
               "Read a DeepSpeed-style JSON config (FILE, or - for standard input) and print\n"
               "the effective settings, defaults included, and the engine options they give.\n"
               "\n"
               "  --strict   treat unknown keys as errors (exit 2)\n"
               "  --ranks N  check it for a job of N ranks (zinf launch -n N), 1-64; default:\n"
               "             WORLD_SIZE where zinf launch set it, else 1\n"
               "\n"
               "Exit status: 0 valid; 1 the settings could not be written out; 2 a bad file\n"
               "(it names the JSON path and what is wrong), a config zinf train refuses\n"
               "(with its defaults, at that many ranks), unknown keys with --strict, or bad\n"
               "usage.\n");
}

static int check(const char *file, bool strict, int ranks)
{
    struct zinf_config c;
    char err[1024];
    const char *path = strcmp(file, "-") ? file : "/dev/stdin";
    size_t flen = strlen(path);
    int ret;

    ret = config_parse_file(path, &c, err, sizeof(err));
    if (ret < 0) {
        /* File and syntax errors already start with the file's name. */
        if (!strncmp(err, path, flen) && err[flen] == ':')
            fprintf(stderr, "zinf: %s\n", err);
        else
            fprintf(stderr, "zinf: %s: %s\n", path, err);
        config_free(&c);
        return 2;
    }
    /* The settings as the file gives them ("auto" as "auto"), kept until the file is known
     * to be good. */
    char *settings = NULL;
    size_t settings_len = 0;
    FILE *mem = open_memstream(&settings, &settings_len);
    int pr = mem ? config_print(&c, mem) : -ENOMEM;
    if (mem && fclose(mem) != 0) pr = -ENOMEM;
    /* What zinf train makes of it with its defaults (at that many ranks): refused here for
     * whatever reason it refuses there, in the same words. */
    struct trainer_opts o;
    struct train_config_applied ds = {0};
    trainer_opts_defaults(&o);
    o.world = ranks;
    if (train_config_apply(&c, &o, 0, &ds, err, sizeof(err)) < 0) {
        fprintf(stderr, "zinf: %s: %s\n", path, err);
        free(settings);
        config_free(&c);
        return 2;
    }
    printf("# zinf config check %s\n", file);
    if (settings) fwrite(settings, 1, settings_len, stdout);
    free(settings);
    printf("# zinf train would run: %d layers, dim %d, %d heads, seq %d, batch %d x %d "
           "accumulated%s, %d steps, %s lr %g (%s schedule)\n",
           o.model.L, o.model.C, o.model.NH, o.seq, o.batch, o.grad_accum,
           ranks > 1 ? " on each rank" : "", o.steps, ds.optimizer, o.lr, ds.scheduler);
    /* The budgets zinf train derives where the config gives none, from this machine's RAM
     * now (trainer_derive_budgets, which train calls too). */
    struct trainer_budgets bud;
    trainer_derive_budgets(&o, &c, false, &bud);
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

int cmd_config(int argc, char **argv)
{
    const char *file = NULL;
    bool strict = false;
    int ranks = 0; /* 0: not given */

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
        if (!strcmp(a, "--strict")) {
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
    return check(file, strict, ranks ? ranks : 1);
}
