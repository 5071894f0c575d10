/*
 * zinf.c - the zinf command line: one binary, one subcommand per job.
 */
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "cmd.h"
#include "tiers/cuda_probe.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: zinf <command> [options]\n"
            "\n"
            "commands:\n"
            "  train     train a byte-level GPT-style model whose state lives in zinf\n"
            "  bench     measure the NVMe swap path (io_uring, O_DIRECT), optionally vs pread/pwrite\n"
            "  tune      sweep the IO settings on the drives to use, write the best as a config\n"
            "  config    check a DeepSpeed-style JSON config: zinf config check FILE\n"
            "  stat      open an engine (from a config, or a swap directory) and print its stats\n"
            "  topo      show the NUMA nodes, GPUs and drives, and where zinf puts its memory\n"
            "  version   print the version and what this build supports\n"
            "  help      this text; 'zinf <command> --help' for a command's options\n");
}

static int cmd_version(void)
{
    struct cuda_probe_info ci;

    printf("zinf %s\n", zinf_version());
    printf("cuda: %s", ZINF_HAVE_CUDA ? "built" : "not built");
    if (cuda_probe(&ci) > 0)
        printf(", %d device(s), device 0: %s\n", ci.device_count, ci.name);
    else
        printf(" (%s)\n", ci.reason);
    printf("kernels: %s\n", ZINF_HAVE_KERNELS ? "built (sm_80, sm_90): zinf train computes on a "
                                               "GPU when the device tier is CUDA"
                                             : "not built: zinf train computes on the CPU");
    printf("nccl: %s\n", ZINF_HAVE_NCCL ? "built" : "not built");
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *c = argv[1];
    if (!strcmp(c, "help") || !strcmp(c, "--help") || !strcmp(c, "-h")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(c, "version") || !strcmp(c, "--version"))
        return cmd_version();
    if (!strcmp(c, "bench"))
        return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(c, "tune"))
        return cmd_tune(argc - 1, argv + 1);
    if (!strcmp(c, "config"))
        return cmd_config(argc - 1, argv + 1);
    if (!strcmp(c, "train"))
        return cmd_train(argc - 1, argv + 1);
    if (!strcmp(c, "stat"))
        return cmd_stat(argc - 1, argv + 1);
    if (!strcmp(c, "topo"))
        return cmd_topo(argc - 1, argv + 1);
    fprintf(stderr, "zinf: unknown command '%s'\n", c);
    usage(stderr);
    return 2;
}
