/*
 * cmd_train_opts.c - `zinf train`'s command line (cmd_train.h): its usage, what zinf launch
 * tells a rank in the environment (WORLD_SIZE, RANK, LOCAL_RANK, ZINF_COMM_*, ZINF_CONNECT),
 * the options and their checks against each other, and the config read and applied under
 * them (train_config_apply()), so that bad input is refused, exit 2, before anything opens.
 *
 * Not here: --init's file, checked against the model these make, and the run (cmd_train.c);
 * what the run prints and logs (cmd_train_report.c).
 */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd_train.h"
#include "comm/comm.h"
#include "common.h"
#include "config.h"
#include "train/train_config.h"
#include "train_options.h"
#include "train/trainer.h"

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
    O_EXPORT_HF,
    O_EXPORT_LORA
};

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
        "  --experts E       mixture of experts (also moe.num_experts): every moe.moe_every-th\n"
        "                    block's MLP is E experts behind a gate (default 0: none); an\n"
        "                    expert is fetched, and updated, only in a step that routes a\n"
        "                    token to it (as torch skips a parameter whose .grad is None;\n"
        "                    Adam's bias correction keeps counting the run's steps). The\n"
        "                    CPU (emulated device); on N ranks the experts are split across\n"
        "                    them (moe.ep_size N)\n"
        "  --top-k K         experts per token, 1 or 2 (also moe.top_k; default 1)\n"
        "  --expert-prefetch N\n"
        "                    experts asked for ahead of their turn, from the gate's choices\n"
        "                    (0-64, default 1; 0: each fetched when its turn comes)\n"
        "  --lora-rank R     LoRA: train rank-R adapters on the targeted linears of every\n"
        "                    block while the model's own weights stay frozen (no gradient,\n"
        "                    no optimizer state); usually with --init. One rank, one\n"
        "                    micro-batch a step, the CPU backend\n"
        "  --lora-alpha A    the adapters' scale is A / R, as PEFT's (default R: a scale of 1)\n"
        "  --lora-targets L  comma-separated, PEFT's names of GPT-2's linears: c_attn, c_proj\n"
        "                    (the attention's and the MLP's), c_fc (default c_attn)\n"
        "  --lora-dropout X  only 0\n"
        "  --export-lora DIR at the end, write the adapters as PEFT saves them:\n"
        "                    DIR/adapter_model.safetensors and DIR/adapter_config.json\n"
        "                    (PeftModel.from_pretrained on --init's GPT-2 loads them); with\n"
        "                    LoRA, --export and --export-hf write the merged weights\n"
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
        "With pipeline.stages P and tensor_parallel.autotp_size T in the config, N is a\n"
        "multiple of P x T: each copy of the model is P stages of consecutive blocks (the\n"
        "micro-batches on the 1F1B schedule; pipeline.partition or zinf.train.pipeline_cut\n"
        "cut them) of T ranks that each hold a slice of every tensor; the copies of a\n"
        "stage's rank are ZeRO ranks (stage 0 or 1 with a pipeline). sequence_parallel_size\n"
        "S instead of T cuts each sequence's positions over S ranks (Ulysses). A pipeline\n"
        "gives bitwise the losses of one rank of --accumulate x copies; tensor- and\n"
        "sequence-parallel ranks give them within 1e-6.\n"
        "Under mpirun (zinf launch --hostfile, or mpirun -np N directly), world, rank and\n"
        "local rank are OMPI_COMM_WORLD_SIZE, _RANK and _LOCAL_RANK, and the ranks meet\n"
        "over MPI across nodes (ZINF_COMM_NAME and ZINF_COMM_SECRET optional).\n"
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

int cmd_train_parse(int argc, char **argv, struct train_args *a)
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
        {"export-lora", required_argument, NULL, O_EXPORT_LORA},
        {"init", required_argument, NULL, O_INIT},
        {"strict", no_argument, NULL, O_STRICT},
        {"dry-run", no_argument, NULL, O_DRY_RUN},
        {"print-lr", required_argument, NULL, O_PRINT_LR},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    struct trainer_opts o;
    int steps_per_print = 1;
    long eval_every = 0, eval_batches = 8, sample_every = 0, sample_bytes = 0;
    const char *log_path = NULL, *trace_path = NULL, *export_path = NULL;
    const char *export_hf = NULL, *init_path = NULL; /* --export-hf DIR, --init FILE */
    const char *export_lora = NULL;                  /* --export-lora DIR */
    char err[512];
    long v = 0;
    int ch;
    unsigned given = 0;   /* bit (option - O_LAYERS) for each model/run option given */
    long ckpt_every = -1; /* -1: not given */
    bool strict = false;  /* --strict: unknown config keys are errors */
    bool dry_run = false; /* --dry-run: decide what would run, run nothing */
    long print_lr = 0;    /* --print-lr N: with --dry-run, the first N steps' learning rates */

    trainer_opts_defaults(&o);
    /* Started as one of several ranks (zinf launch -n N): the trainer partitions the state
     * by zero_optimization.stage, and this rank runs its own micro-batches. */
    /* Started by mpirun (zinf launch --hostfile, or mpirun directly): the rank and world
     * are Open MPI's, and the communicator meets over MPI across nodes. WORLD_SIZE, where
     * set, wins: a launcher of its own inside an MPI job. */
    static const char *const vars[2][3] = {
        {"WORLD_SIZE", "RANK", "LOCAL_RANK"},
        {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"}};
    const char *ws = getenv("WORLD_SIZE");
    o.mpi = !(ws && *ws) && getenv("OMPI_COMM_WORLD_SIZE") && *getenv("OMPI_COMM_WORLD_SIZE");
    const char *const *var = vars[o.mpi];
    const char *setter = o.mpi ? "mpirun sets them" : "zinf launch sets them";
    ws = getenv(var[0]);
    const char *rk = getenv(var[1]);
    if (ws && *ws) {
        char *e1 = NULL, *e2 = NULL;
        long w = strtol(ws, &e1, 10), k = rk && *rk ? strtol(rk, &e2, 10) : -1;
        if (*e1 || w < 1 || w > 64 || !e2 || *e2 || k < 0 || k >= w) {
            fprintf(stderr,
                    "zinf train: %s '%s' and %s '%s': expected 1 <= %s <= 64 and 0 <= %s < %s "
                    "(%s)\n",
                    var[0], ws, var[1], rk ? rk : "", var[0], var[1], var[0], setter);
            return 2;
        }
        o.world = (int)w;
        o.rank = (int)k;
        /* On GPUs each rank takes the GPU of its local rank (its place on its node). */
        const char *lr = getenv(var[2]);
        if (lr && *lr) {
            char *e3 = NULL;
            long l = strtol(lr, &e3, 10);
            if (*e3 || l < 0 || l >= 64) {
                fprintf(stderr, "zinf train: %s '%s': expected 0 <= %s < 64 (%s)\n", var[2], lr,
                        var[2], setter);
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
        case O_EXPORT_LORA:
            export_lora = optarg;
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
    if (export_lora && !o.lora.r) {
        fprintf(stderr, "zinf train: --export-lora %s: the run trains no adapters (give "
                "--lora-rank)\n", export_lora);
        return 2;
    }
    o.sample = sample_every > 0;
    if (sample_bytes == 0) sample_bytes = MIN(64, o.seq - 1);
    if (o.sample && sample_bytes > o.seq - 1) {
        fprintf(stderr,
                "zinf train: --sample-bytes %ld: at most --seq - 1 = %d (the context "
                "is one sequence)\n",
                sample_bytes, o.seq - 1);
        return 2;
    }
    *a = (struct train_args){.o = o,
                             .ds = ds,
                             .log_path = log_path,
                             .trace_path = trace_path,
                             .export_path = export_path,
                             .export_hf = export_hf,
                             .export_lora = export_lora,
                             .init_path = init_path,
                             .eval_every = eval_every,
                             .eval_batches = eval_batches,
                             .sample_every = sample_every,
                             .sample_bytes = sample_bytes,
                             .ckpt_every = ckpt_every,
                             .print_lr = print_lr,
                             .steps_per_print = steps_per_print,
                             .dry_run = dry_run,
                             .nvme_offload = nvme_offload};
    return -1;
}
