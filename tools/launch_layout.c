/*
 * launch_layout.c - `zinf launch -n N -- zinf train --config FILE`: N against the layout
 * of FILE before any rank starts. Each copy of the model is P pipeline stages
 * (pipeline.stages) of T tensor-parallel (tensor_parallel.autotp_size) or S sequence-
 * parallel (sequence_parallel_size) ranks; N must be a multiple of P x T x S, and T and S
 * are not both above 1; with MoE (moe.num_experts) the experts are split across the copies
 * (all N ranks without those layouts), so moe.ep_size must be N / (P x T x S). Without this the N ranks start, each reads
 * the config and each refuses on its own; here one line says it, and which -n would fit,
 * and nothing starts.
 *
 * FILE is read with the parser zinf train reads it with (src/config.c), quietly (its ranks
 * warn of unknown keys). A config that does not parse is left to the ranks, which say
 * what is wrong with it: the launcher never refuses what zinf train would take.
 *
 * Not here: the ranks' own checks of the layout against the model (heads, blocks, ZeRO
 * stages; src/train/trainer_pipe.c), the MoE settings besides ep_size (trainer_moe.c).
 */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "comm/comm.h"
#include "common.h"
#include "config.h"
#include "launch_layout.h"

bool launch_is_zinf(const char *prog)
{
    const char *base = strrchr(prog, '/');
    base = base ? base + 1 : prog;
    if (!strcmp(base, "zinf")) return true;
    /* Under another name (a link, a copy renamed): the same file as ours. */
    struct stat a, b;
    return strchr(prog, '/') && stat(prog, &a) == 0 && stat("/proc/self/exe", &b) == 0 &&
           a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

const char *launch_train_config(char *const *command)
{
    if (!command[0] || !launch_is_zinf(command[0]) || !command[1] ||
        strcmp(command[1], "train"))
        return NULL;
    const char *cfg = NULL;
    for (int i = 2; command[i]; i++) {
        if (!strcmp(command[i], "--")) break; /* what follows is no option of zinf train's */
        if (!strcmp(command[i], "--config") && command[i + 1])
            cfg = command[++i];
        else if (!strncmp(command[i], "--config=", 9))
            cfg = command[i] + 9;
    }
    return cfg && *cfg ? cfg : NULL;
}

/* "pipeline.stages 2 x tensor_parallel.autotp_size 2": the keys above 1, with their values. */
static void keys(char *buf, size_t len, int P, int T, int S)
{
    size_t at = 0;
    buf[0] = 0;
    if (P > 1) at += (size_t)snprintf(buf + at, len - at, "pipeline.stages %d", P);
    if (T > 1 && at < len)
        at += (size_t)snprintf(buf + at, len - at, "%stensor_parallel.autotp_size %d",
                               at ? " x " : "", T);
    if (S > 1 && at < len)
        snprintf(buf + at, len - at, "%ssequence_parallel_size %d", at ? " x " : "", S);
}

int launch_layout_check(char *const *command, int n)
{
    const char *path = launch_train_config(command);
    if (!path) return 0;
    struct zinf_config zc;
    char err[512];
    int r = config_parse_file_flags(path, &zc, CONFIG_PARSE_QUIET, err, sizeof(err));
    int P = MAX(1, zc.pipeline.stages), T = MAX(1, zc.tensor_parallel.autotp_size),
        S = MAX(1, zc.sequence_parallel_size);
    int E = zc.moe.num_experts, ep = MAX(1, zc.moe.ep_size);
    config_free(&zc);
    if (r < 0) return 0; /* the ranks say what is wrong with it */
    /* The experts are split across the ZeRO ranks, all of them. */
    if (E > 0 && P * T * S == 1 && ep != n) {
        fprintf(stderr,
                "zinf launch: -n %d does not fit %s: moe.ep_size %d splits the %d experts "
                "across that many ranks, all of the job's; use -n %d, or set ep_size to %d\n",
                n, path, ep, E, ep, n);
        return 2;
    }
    if (P * T * S == 1) return 0;
    if (T > 1 && S > 1) {
        fprintf(stderr,
                "zinf launch: %s: tensor_parallel.autotp_size %d with sequence_parallel_size "
                "%d: both cut the heads; use one of them\n",
                path, T, S);
        return 2;
    }
    int per = P * T * S; /* ranks per copy of the model */
    if (n % per) {
        char what[160];
        keys(what, sizeof(what), P, T, S);
        char fit[96] = "";
        size_t at = 0;
        for (int k = 1; k <= 3 && k * per <= COMM_MAX_RANKS; k++)
            at += (size_t)snprintf(fit + at, sizeof(fit) - at, "%s%d", k > 1 ? ", " : "",
                                   k * per);
        if (at && 4 * per <= COMM_MAX_RANKS) snprintf(fit + at, sizeof(fit) - at, "...");
        fprintf(stderr, "zinf launch: -n %d does not fit %s: %s = %d ranks per copy of the model; ",
                n, path, what, per);
        if (at)
            fprintf(stderr, "use -n %s\n", fit);
        else
            fprintf(stderr, "no -n fits (a job has at most %d ranks)\n", COMM_MAX_RANKS);
        return 2;
    }
    if (E > 0 && ep != n / per) {
        fprintf(stderr,
                "zinf launch: -n %d does not fit %s: moe.ep_size %d splits the %d experts "
                "across the copies of each stage, %d here; set ep_size to %d\n",
                n, path, ep, E, n / per, n / per);
        return 2;
    }
    char layout[160];
    size_t at = (size_t)snprintf(layout, sizeof(layout), "%d cop%s", n / per,
                                 n / per == 1 ? "y" : "ies");
    if (P > 1) at += (size_t)snprintf(layout + at, sizeof(layout) - at, " x %d stages", P);
    if (T > 1)
        snprintf(layout + at, sizeof(layout) - at, " x %d tensor-parallel ranks", T);
    else if (S > 1)
        snprintf(layout + at, sizeof(layout) - at, " x %d sequence-parallel ranks", S);
    fprintf(stderr, "zinf launch: %d ranks = %s\n", n, layout);
    return 0;
}
