/*
 * zinf.c - the zinf command line: one binary, one subcommand per job. `zinf help CMD` prints
 * the command's page (docs/commands/CMD.md, built in as cmd_pages.c by embed_docs.py).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "cmd.h"
#include "cmd_pages.h"
#include "comm/comm.h"
#include "tiers/cuda_probe.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: zinf <command> [options]\n"
            "\n"
            "commands:\n"
            "  train     train a byte-level GPT-style model whose state lives in zinf\n"
            "  plot      draw a zinf train --log file as a PNG (gnuplot)\n"
            "  compare   are two zinf train --log runs the same? losses and digests, by step\n"
            "  bench     measure the NVMe swap path (io_uring, O_DIRECT), optionally vs pread/pwrite\n"
            "  tune      sweep the IO settings on the drives to use, write the best as a config\n"
            "  config    check a DeepSpeed-style JSON config: zinf config check FILE\n"
            "  stat      open an engine (from a config, or a swap directory) and print its stats\n"
            "  serve     run the node's daemon: trainers attach to jobs over a Unix socket\n"
            "  job       list, close or remove the jobs of a daemon: zinf job list --socket S\n"
            "  launch    start the N ranks of a job on this node: zinf launch -n N -- COMMAND\n"
            "  topo      show the NUMA nodes, GPUs and drives, and where zinf puts its memory\n"
            "  version   print the version and what this build supports\n"
            "  help      this text; 'zinf help <command>' prints the command's full page\n"
            "            (every option, the exit statuses); 'zinf <command> --help' its options\n"
            "\n"
            "Exit status, every command: 0 success, 1 a runtime failure, 2 bad usage or bad\n"
            "input; train and tune also 130/143 when stopped by SIGINT/SIGTERM.\n"
            "ZINF_LOG=error|warn|notice|debug sets how much the library says on stderr.\n"
            "OMP_WAIT_POLICY is passive unless set: OpenMP's threads sleep between parallel\n"
            "regions instead of spinning against the engine's IO and copy threads.\n");
}

static void version_usage(FILE *f)
{
    fprintf(f, "usage: zinf version [--json]\n"
               "The version, and what this build supports: CUDA (and whether a GPU is usable\n"
               "here, or why not), the GPU kernels, NCCL (and whether libnccl loads here).\n"
               "  --json   one JSON object instead of the text\n"
               "Exit status: 0 printed, 2 bad usage.\n");
}

static int cmd_version(int argc, char **argv)
{
    struct cuda_probe_info ci;
    bool json = false;

    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) {
            json = true;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            version_usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "zinf: version: unknown option '%s'\n", argv[i]);
            version_usage(stderr);
            return 2;
        }
    }
    int gpus = cuda_probe(&ci);
    int nccl_ver = 0;
    char nccl_why[256] = "";
    bool nccl_loads = comm_nccl_version(&nccl_ver, nccl_why, sizeof(nccl_why)) == 0;
    if (json) {
        printf("{\"version\": \"%s\", \"cuda_built\": %s, \"gpu_usable\": %s, \"gpus\": %d, "
               "\"gpu0\": ", zinf_version(), ZINF_HAVE_CUDA ? "true" : "false",
               gpus > 0 ? "true" : "false", gpus > 0 ? gpus : 0);
        json_print_string(stdout, gpus > 0 ? ci.name : NULL);
        printf(", \"gpu_unusable_reason\": ");
        json_print_string(stdout, gpus > 0 ? NULL : ci.reason);
        printf(", \"cuda_runtime_version\": %d, \"cuda_driver_version\": %d, "
               "\"kernels_built\": %s, \"nccl_built\": %s, \"nccl_version\": ", ci.runtime_version,
               ci.driver_version, ZINF_HAVE_KERNELS ? "true" : "false",
               ZINF_HAVE_NCCL ? "true" : "false");
        if (nccl_loads)
            printf("%d", nccl_ver);
        else
            printf("null");
        printf(", \"nccl_unloadable_reason\": ");
        json_print_string(stdout, nccl_loads ? NULL : nccl_why);
        printf("}\n");
        return 0;
    }
    printf("zinf %s\n", zinf_version());
    if (!ZINF_HAVE_CUDA)
        printf("cuda: not built (no CUDA toolkit when this was built)\n");
    else if (gpus > 0)
        printf("cuda: built; GPU: %d usable, device 0: %s\n", gpus, ci.name);
    else
        printf("cuda: built; GPU: not usable (%s)\n", ci.reason);
    printf("kernels: %s\n", ZINF_HAVE_KERNELS ? "built (sm_80, sm_90): zinf train computes on a "
                                               "GPU when the device tier is CUDA"
                                             : "not built: zinf train computes on the CPU");
    if (!ZINF_HAVE_NCCL)
        printf("nccl: not built (no nccl.h when this was built)\n");
    else if (nccl_loads)
        printf("nccl: built; libnccl %d.%d.%d loads (the nccl backend of the collectives)\n",
               nccl_ver / 10000, nccl_ver / 100 % 100, nccl_ver % 100);
    else
        printf("nccl: built; libnccl does not load (%s)\n", nccl_why);
    return 0;
}

/* The commands, in the order usage() lists them ("help" is main's own). */
static const struct command {
    const char *name;
    int (*fn)(int argc, char **argv);
} commands[] = {
    {"train", cmd_train},   {"plot", cmd_plot},   {"compare", cmd_compare},
    {"bench", cmd_bench},   {"tune", cmd_tune},   {"config", cmd_config},
    {"stat", cmd_stat},     {"serve", cmd_serve}, {"job", cmd_job},
    {"launch", cmd_launch}, {"topo", cmd_topo},   {"version", cmd_version},
};

/* argv[0] is the command's name. Returns the exit status, or -1 for an unknown command. */
static int run(int argc, char **argv)
{
    const char *c = argv[0];
    if (!strcmp(c, "--version")) return cmd_version(argc, argv);
    for (size_t i = 0; i < ARRAY_SIZE(commands); i++)
        if (!strcmp(c, commands[i].name)) return commands[i].fn(argc, argv);
    return -1;
}

/* The page of the command called name (docs/commands/NAME.md), or NULL. */
static const char *command_page(const char *name)
{
    for (size_t i = 0; i < cmd_pages_count; i++)
        if (!strcmp(name, cmd_pages[i].name)) return cmd_pages[i].text;
    return NULL;
}

/* "zinf: WHAT 'c'", with the command c most likely misspells when one is near
 * (nearest_name), then the usage. */
static void unknown_command(const char *what, const char *c)
{
    const char *names[ARRAY_SIZE(commands) + 1];
    size_t n = 0;
    for (; n < ARRAY_SIZE(commands); n++)
        names[n] = commands[n].name;
    names[n++] = "help";
    const char *near = nearest_name(c, names, n);
    fprintf(stderr, "zinf: %s '%s'", what, c);
    if (near) fprintf(stderr, " (did you mean '%s'?)", near);
    fputc('\n', stderr);
    usage(stderr);
}

/* OpenMP's threads sleep between parallel regions rather than spin (OMP_WAIT_POLICY
 * passive, unless the environment says otherwise). Spinning, they take the CPUs the engine's
 * IO and copy threads need: an offloaded 4 x 256 step on 2 CPUs took 108-128 ms spinning and
 * 98-100 ms passive (in memory the two are within a few percent). (They also fought OpenBLAS's
 * own threads, 4.2 s against 2.8 s a 12 x 768 step, before the GEMMs moved onto the OpenMP
 * threads.) libgomp reads the variable when
 * it loads, before main, so the program runs itself again with it set. If that exec fails,
 * it goes on as it is: slower, with the same results. */
static void openmp_passive(char **argv)
{
    if (getenv("OMP_WAIT_POLICY") || setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
    execv("/proc/self/exe", argv);
}

int main(int argc, char **argv)
{
    openmp_passive(argv);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *c = argv[1];
    if (!strcmp(c, "help") && argc >= 3 && strcmp(argv[2], "help")) {
        /* zinf help CMD: the command's page; a name with no page, what zinf CMD --help
         * prints (zinf help --version). */
        const char *page = command_page(argv[2]);
        if (page) {
            fputs(page, stdout);
            return fflush(stdout) == 0 ? 0 : 1;
        }
        char *hargv[] = {argv[2], "--help", NULL};
        int r = run(2, hargv);
        if (r >= 0)
            return r;
        unknown_command("help: unknown command", argv[2]);
        return 2;
    }
    if (!strcmp(c, "help") || !strcmp(c, "--help") || !strcmp(c, "-h")) {
        usage(stdout);
        return 0;
    }
    int r = run(argc - 1, argv + 1);
    if (r >= 0)
        return r;
    unknown_command("unknown command", c);
    return 2;
}
