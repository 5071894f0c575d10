/*
 * cmd_config.c - `zinf config check FILE [--strict]`: read a DeepSpeed-style JSON config
 * the way the engine will, and print every effective setting (defaults included), the
 * engine options derived from them and the keys that were ignored or unknown.
 *
 * It checks the file, not the machine: whether the NVMe directories exist or the GPU is
 * there is left to the commands that use them.
 */
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "cmd.h"
#include "train/trainer.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf config check FILE [--strict]\n"
               "\n"
               "Read a DeepSpeed-style JSON config (FILE, or - for standard input) and print\n"
               "the effective settings, defaults included, and the engine options they give.\n"
               "\n"
               "  --strict   treat unknown keys as errors (exit 2)\n"
               "\n"
               "Exit status: 0 valid; 1 the settings could not be written out; 2 a bad file\n"
               "(it names the JSON path and what is wrong), unknown keys with --strict, or\n"
               "bad usage.\n");
}

static int check(const char *file, bool strict)
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
    printf("# zinf config check %s\n", file);
    int pr = config_print(&c, stdout);
    /* "auto" as zinf train resolves it: from the model of zinf.train, else its defaults. */
    struct trainer_opts o;
    trainer_opts_defaults(&o);
    struct config_auto_inputs in = {
        .hidden_size = c.zinf.train.dim ? c.zinf.train.dim : o.model.C,
        .micro_batch = c.zinf.train.batch ? c.zinf.train.batch : o.batch, .grad_accum = 1,
        .steps = c.zinf.train.steps ? c.zinf.train.steps : o.steps, .lr = o.lr,
        .weight_decay = o.weight_decay, .grad_clip = o.grad_clip, .bf16 = -1};
    char autos[1024];
    config_resolve_auto(&c, &in, autos, sizeof(autos));
    if (config_is_auto(&c, "bf16.enabled")) {
        size_t n = strlen(autos);
        snprintf(autos + n, sizeof(autos) - n, "%sbf16.enabled = as --precision auto (bf16 on "
                 "a GPU, fp32 on the CPU)", n ? "\n" : "");
    }
    if (autos[0]) {
        printf("# \"auto\" as zinf train resolves it with dim %d, batch %d, %d steps (from "
               "zinf.train or its defaults; its options change them):\n", in.hidden_size,
               in.micro_batch, in.steps);
        for (char *p = autos, *nl; p; p = nl ? nl + 1 : NULL) {
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

int cmd_config(int argc, char **argv)
{
    const char *file = NULL;
    bool strict = false;

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
    return check(file, strict);
}
