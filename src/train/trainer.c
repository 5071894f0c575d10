/*
 * trainer.c - a training run's life (see trainer.h): trainer_open reads the config and the
 * data, connects or opens the engine (resuming, starting over or re-cutting a saved run),
 * registers the model's tensors and checks the budgets; trainer_close ends it, flushed or
 * not. Beside those: the options' defaults and checks, the batch of a step and the summary.
 *
 * Not here: the step itself (trainer_step.c), the tensors and budgets (trainer_tensors.c),
 * the mixture-of-experts blocks (trainer_moe.c),
 * the ranks' partitions (trainer_shards.c), the optimizer (trainer_optim.c), checkpoints
 * and resuming (trainer_resume.c), the saved runs of every layout and the one a resume goes
 * to (trainer_layouts.c), the learning-rate schedule (trainer_schedule.c),
 * evaluation and sampling (trainer_sample.c). What they share is in trainer_impl.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common.h"
#include "config.h"
#include "tiers/cuda_probe.h"
#include "train/adamw_states.h"
#include "train/backend.h"
#include "train/gpt_lora.h"
#include "train/onebit.h"
#include "train/loss_scale.h"
#include "train/trainer_impl.h"
#include "trace.h"

void trainer_opts_defaults(struct trainer_opts *o)
{
    *o = (struct trainer_opts){.batch = 4,
                               .seq = 64,
                               .steps = 100,
                               .lr = 1e-3f,
                               .weight_decay = 0.0f,
                               .grad_clip = 1.0f,
                               .seed = 1337,
                               .beta1 = 0.9f,
                               .beta2 = 0.999f,
                               .eps = 1e-8f,
                               .lamb_max_coeff = 10.0f,
                               .lamb_min_coeff = 0.01f,
                               .grad_accum = 1,
                               .local_rank = -1};
    o->fp16 = (struct trainer_fp16){
        .min_loss_scale = 1, .initial_scale_power = 16, .loss_scale_window = 1000, .hysteresis = 2};
    o->model = (struct gpt_config){.V = 256, .maxT = 64, .L = 4, .C = 128, .NH = 4};
    o->lora = (struct trainer_lora){.targets = 1u << GPT_LORA_QKV};
    o->moe = (struct trainer_moe){.k = 1, .every = 1, .ep = 1, .prefetch = 1, .min_capacity = 4,
                                  .drop_tokens = true, .capacity_factor = 1, .loss_coef = 0.01f};
}

int trainer_next_step(const struct trainer *t)
{
    return t->step_done + 1;
}

zinf_engine *trainer_engine(struct trainer *t)
{
    return t->e;
}

int trainer_finish_update(struct trainer *t)
{
    return train_update_finish(t);
}

enum zinf_tier train_home_of(enum config_offload_device d)
{
    return d == CONFIG_OFFLOAD_NVME  ? ZINF_TIER_NVME
           : d == CONFIG_OFFLOAD_CPU ? ZINF_TIER_HOST
                                     : ZINF_TIER_DEVICE;
}

/* ---- setup -------------------------------------------------------------------------- */

static int load_data(struct trainer *t, char *err, size_t errlen)
{
    struct stat st;
    int fd = open(t->o.data_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) < 0) {
        int r = -errno;
        snprintf(err, errlen, "%s: %s", t->o.data_path, strerror(errno));
        if (fd >= 0) close(fd);
        return r;
    }
    if (S_ISDIR(st.st_mode)) {
        snprintf(err, errlen, "--data %s is a directory: give a file, whose bytes are the tokens",
                 t->o.data_path);
        close(fd);
        return -EISDIR;
    }
    if (!S_ISREG(st.st_mode) || (size_t)st.st_size < (size_t)t->o.seq + 1) {
        snprintf(err, errlen, "%s: the data file must hold at least --seq + 1 = %d bytes",
                 t->o.data_path, t->o.seq + 1);
        close(fd);
        return -EINVAL;
    }
    t->data_bytes = (size_t)st.st_size;
    t->data = malloc(t->data_bytes);
    size_t got = 0;
    while (t->data && got < t->data_bytes) {
        ssize_t n = read(fd, t->data + got, t->data_bytes - got);
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    if (!t->data || got != t->data_bytes) {
        snprintf(err, errlen, "%s: cannot read it whole", t->o.data_path);
        return -EIO;
    }
    return 0;
}

/* SplitMix64's finaliser: a batch's window offsets and sampling's draws. */
uint64_t train_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Micro-batch m of step s: B windows of T+1 bytes at offsets drawn from (seed, s, m). */
void train_load_batch(struct trainer *t, int s, int m)
{
    int B = t->o.batch, T = t->o.seq;
    uint64_t span = t->train_bytes - (size_t)T;
    for (int b = 0; b < B; b++) {
        uint64_t off = train_mix64(t->o.seed * 0x9e3779b97f4a7c15ull + (uint64_t)s * 1000003u +
                                   (uint64_t)m * (uint64_t)B + (uint64_t)b) %
                       span;
        for (int i = 0; i < T; i++) {
            t->tokens[b * T + i] = t->data[off + (size_t)i];
            t->targets[b * T + i] = t->data[off + (size_t)i + 1];
        }
    }
}

void train_note_peaks(struct trainer *t)
{
    struct zinf_stats st;
    if (zinf_stats(t->e, &st) < 0) return;
    for (int i = 0; i < 3; i++)
        t->peak[i] = MAX(t->peak[i], st.tier[i].peak_bytes);
}

void trainer_auto_inputs(const struct trainer_opts *o, struct config_auto_inputs *in)
{
    *in = (struct config_auto_inputs){.hidden_size = o->model.C,
                                      .micro_batch = o->batch,
                                      .grad_accum = o->grad_accum,
                                      .steps = o->steps,
                                      .lr = o->lr,
                                      .weight_decay = o->weight_decay,
                                      .grad_clip = o->grad_clip,
                                      .bf16 = o->precision == TRAINER_PRECISION_BF16,
                                      .fp16 = o->precision == TRAINER_PRECISION_FP16};
}

int trainer_opts_check(const struct trainer_opts *o, char *err, size_t errlen)
{
    if (o->model.V != 256) {
        snprintf(err, errlen, "the vocabulary is bytes: V must be 256");
        return -EINVAL;
    }
    if (o->batch < 1 || o->seq < 1 || o->steps < 0 || !(o->lr >= 0) || !(o->grad_clip >= 0)) {
        snprintf(err, errlen, "--batch and --seq must be >= 1, --steps >= 0, --lr >= 0");
        return -EINVAL;
    }
    if (o->grad_accum < 1 || !(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1) ||
        !(o->eps > 0) || !(o->weight_decay >= 0)) {
        snprintf(err, errlen,
                 "the gradient accumulation steps must be >= 1, Adam's betas in "
                 "[0, 1), eps > 0 and the weight decay >= 0");
        return -EINVAL;
    }
    if ((o->sched.type == TRAINER_SCHED_WARMUP_DECAY ||
         o->sched.type == TRAINER_SCHED_WARMUP_COSINE) &&
        o->sched.total_steps < 1) {
        snprintf(err, errlen, "scheduler.params.total_num_steps: %s needs it (>= 1)",
                 o->sched.type == TRAINER_SCHED_WARMUP_DECAY ? "WarmupDecayLR" : "WarmupCosineLR");
        return -EINVAL;
    }
    if (o->sched.type == TRAINER_SCHED_ONE_CYCLE) {
        const struct trainer_lr_schedule *s = &o->sched;
        if (!(s->cycle_first_size > 0) || (s->cycle_second_size < 0 && s->cycle_second_size != -1)) {
            snprintf(err, errlen,
                     "scheduler.params.cycle_first_step_size must be > 0 and "
                     "cycle_second_step_size >= 0 (OneCycle)");
            return -EINVAL;
        }
        /* beta1 is cycle_min_mom at step 1, between the two bounds within the cycle, and
         * monotonic in the decay after it: step 1, cycle_max_mom and the last step are its
         * extremes. */
        int last = MAX(o->steps, 1);
        double b1, b2, max_mom = s->cycle_max_mom;
        for (int k = 0; s->cycle_momentum && k < 3; k++) {
            int st = k == 0 ? 1 : last;
            trainer_betas_at(s, o->beta1, o->beta2, st, &b1, &b2);
            if (k == 1 && last >= 2) b1 = max_mom;
            if (!((float)b1 >= 0 && (float)b1 < 1)) {
                if (k == 1)
                    snprintf(err, errlen,
                             "OneCycle's cycle_max_mom %g: Adam's beta1 must be in [0, 1)", b1);
                else
                    snprintf(err, errlen,
                             "OneCycle's momentum reaches %g at step %d: Adam's beta1 must be in "
                             "[0, 1) (cycle_min_mom, cycle_max_mom, decay_mom_rate)",
                             b1, st);
                return -EINVAL;
            }
        }
    }
    if (o->optimizer == TRAINER_OPT_LAMB &&
        !(o->lamb_min_coeff >= 0 && o->lamb_max_coeff >= o->lamb_min_coeff)) {
        snprintf(err, errlen,
                 "Lamb's min_coeff %g and max_coeff %g: need 0 <= min_coeff <= max_coeff",
                 o->lamb_min_coeff, o->lamb_max_coeff);
        return -EINVAL;
    }
    if (!adamw_state_dtype_name((enum adamw_state_dtype)o->state_dtype)) {
        snprintf(err, errlen, "zinf.optimizer_state_dtype %d: must be fp32, bf16 or int8",
                 o->state_dtype);
        return -EINVAL;
    }
    if (o->state_dtype != ADAMW_STATE_FP32 && o->optimizer == TRAINER_OPT_LAMB) {
        snprintf(err, errlen,
                 "zinf.optimizer_state_dtype \"%s\": Lamb keeps its states in fp32; give "
                 "\"fp32\" with optimizer.type Lamb",
                 adamw_state_dtype_name((enum adamw_state_dtype)o->state_dtype));
        return -EINVAL;
    }
    struct gpt_config cfg = o->model;
    cfg.maxT = o->seq;
    if (gpt_config_validate(&cfg, err, errlen) < 0) return -EINVAL;
    int r = train_moe_opts_check(o, err, errlen);
    return r < 0 ? r : train_lora_opts_check(o, err, errlen);
}

/* A trainer with nothing opened yet: its locks and markers, the options, the model. */
static struct trainer *trainer_new(const struct trainer_opts *o)
{
    struct trainer *t = calloc(1, sizeof(*t));
    if (!t) return NULL;
    pthread_mutex_init(&t->gmu, NULL);
    pthread_cond_init(&t->gcv, NULL);
    pthread_mutex_init(&t->umu, NULL);
    pthread_cond_init(&t->ucv, NULL);
    t->gw_holds[0] = t->gw_holds[1] = -1;
    t->resume_step = -1;
    t->o = *o;
    t->cfg = o->model;
    t->cfg.maxT = o->seq;
    return t;
}

/* What the config makes of the run, as trainer_open and trainer_plan both decide it: the
 * config read and its "auto" resolved, the persistent parameters, local or through the
 * daemon, the GPU or the emulated device, and the budgets the config does not give. */
static int decide(struct trainer *t, bool *cuda_out, char *err, size_t errlen)
{
    const struct trainer_opts *o = &t->o;
    int r;
    config_defaults(&t->zc);
    /* Quietly: the command that built o read the file and warned of its unknown keys. */
    if ((r = config_parse_file_flags(o->config_path, &t->zc, CONFIG_PARSE_QUIET, err, errlen)) < 0)
        goto fail;
    /* "auto" (Hugging Face's configs) as the command resolved it: the engine's prefetch
     * budget comes from the model's width. */
    struct config_auto_inputs ai;
    trainer_auto_inputs(o, &ai);
    char resolved[1024];
    config_resolve_auto(&t->zc, &ai, resolved, sizeof(resolved));
    /* DeepSpeed's persistent parameters, when the config sets the threshold ("auto": ten
     * times the width); without it every weight stays in its offload home. */
    if (config_given(&t->zc, "zero_optimization.stage3_param_persistence_threshold"))
        t->persist_below = t->zc.zero.stage3_param_persistence_threshold;
    /* Through the daemon (--connect, zinf.connect): its job's device tier is emulated in
     * memory it shares with this process, so the math runs on the CPU. */
    if (!t->o.connect && t->zc.zinf.connect.count) t->o.connect = t->zc.zinf.connect.path[0];
    if (!t->o.job) t->o.job = t->zc.zinf.job[0] ? t->zc.zinf.job : TRAINER_DEFAULT_JOB;
    t->remote = t->o.connect != NULL;
    if (t->remote) t->zc.zinf.device = ZINF_DEVICE_EMULATED;
    /* The device tier and the backend go together: the CUDA kernels where the tier is a
     * GPU, the CPU over the emulated tier otherwise. */
    bool cuda = false;
    if (t->zc.zinf.device != ZINF_DEVICE_EMULATED) {
        struct cuda_probe_info ci = {0};
        bool built = backend_cuda_built();
        int ngpu = built ? cuda_probe(&ci) : 0;
        bool usable = ngpu > 0;
        if (t->zc.zinf.device == ZINF_DEVICE_CUDA && !usable) {
            snprintf(err, errlen, "zinf.device is \"cuda\" but %s; use \"auto\" or \"emulated\"",
                     !built ? "this build has no CUDA kernels (no CUDA toolkit when it was built)"
                     : ci.reason[0] ? ci.reason
                                    : "no GPU is usable");
            r = -ENODEV;
            goto fail;
        }
        cuda = usable;
        /* GPU ranks: one per GPU, LOCAL_RANK's. */
        if (cuda && o->world > 1 && o->local_rank >= 0) {
            if (o->local_rank >= ngpu) {
                snprintf(err, errlen,
                         "LOCAL_RANK %d: this node has %d usable GPU%s, and each rank takes one "
                         "(start at most %d ranks, or use zinf.device \"emulated\")",
                         o->local_rank, ngpu, ngpu == 1 ? "" : "s", ngpu);
                r = -ENODEV;
                goto fail;
            }
            t->zc.zinf.cuda_device = o->local_rank;
        }
    }
    t->zc.zinf.device = cuda ? ZINF_DEVICE_CUDA : ZINF_DEVICE_EMULATED;
    /* Budgets the config does not give: derived from the machine and the run (a daemon's
     * job has its own). */
    if (!t->remote) {
        trainer_derive_budgets(o, &t->zc, cuda, &t->budgets);
        if (t->budgets.device) t->zc.zinf.device_bytes = t->budgets.device;
        if (t->budgets.host) t->zc.zinf.host_bytes = t->budgets.host;
    }
    *cuda_out = cuda;
    return 0;
fail:
    return r;
}

/* The model's tensors in gpt_layout()'s order, and the arrays of their handles. */
static int layout(struct trainer *t, char *err, size_t errlen)
{
    const struct gpt_config cfg = t->cfg;
    t->ntensors = train_moe_layout(t, NULL, 0, err, errlen);
    if (t->ntensors < 0) return t->ntensors;
    t->ntensors += train_lora_count(t); /* appended after the model's */
    t->desc = calloc((size_t)t->ntensors, sizeof(*t->desc));
    t->p = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->g = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->m = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->v = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->w = t->be->wdt == BACKEND_F32 ? t->p : calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->block_first = calloc((size_t)cfg.L, sizeof(int));
    t->act = calloc((size_t)(cfg.L + 1) * (size_t)MAX(1, t->nslots), sizeof(zinf_tensor));
    if (!t->desc || !t->p || !t->g || !t->m || !t->v || !t->w || !t->block_first || !t->act) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    int r = train_moe_layout(t, t->desc, (size_t)(t->ntensors - train_lora_count(t)), err, errlen);
    if (r < 0 || (r = train_lora_layout(t, err, errlen)) < 0) return r;
    /* The rank's tensors (a pipeline stage's, a tensor-parallel rank's slices), indexed. */
    if (train_pipe_layout(t) < 0) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    return 0;
}

static enum backend_dtype weight_dtype(const struct trainer_opts *o, bool cuda)
{
    return o->precision == TRAINER_PRECISION_FP16   ? BACKEND_F16
           : o->precision == TRAINER_PRECISION_BF16 ? BACKEND_BF16
           : o->precision == TRAINER_PRECISION_FP32 ? BACKEND_F32
           : cuda                                   ? BACKEND_BF16
                                                    : BACKEND_F32;
}

static enum zinf_tier optimizer_tier(const struct trainer *t)
{
    return train_home_of(t->zc.zero.offload_optimizer.device) == ZINF_TIER_DEVICE
               ? ZINF_TIER_DEVICE
               : ZINF_TIER_HOST;
}

int trainer_plan(const struct trainer_opts *o, struct trainer_plan *p, char *err, size_t errlen)
{
    int r;
    bool cuda = false;
    *p = (struct trainer_plan){0};
    err[0] = '\0';
    if ((r = trainer_opts_check(o, err, errlen)) < 0) return r;
    if (!o->config_path) {
        snprintf(err, errlen, "--config FILE is required");
        return -EINVAL;
    }
    struct trainer *t = trainer_new(o);
    if (!t) return -ENOMEM;
    if ((r = decide(t, &cuda, err, errlen)) < 0) goto out;
    struct backend_params bp = {.cfg = t->cfg, .B = o->batch, .T = o->seq,
                                .wdt = weight_dtype(o, cuda)};
    if ((r = backend_params_check(&bp, err, errlen)) < 0) goto out;
    /* The backend's data types are all the budgets take of it. */
    struct backend dtypes = {.name = cuda ? "cuda" : "cpu", .wdt = bp.wdt,
                             .adt = backend_act_dtype(cuda, bp.wdt)};
    t->be = &dtypes;
    t->opt_tier = optimizer_tier(t);
    if ((r = train_zero_shape(t, false, err, errlen)) < 0) goto out;
    if ((r = layout(t, err, errlen)) < 0 || (r = train_act_mode(t, err, errlen)) < 0) goto out;
    p->budget[ZINF_TIER_DEVICE] = t->zc.zinf.device_bytes;
    p->budget[ZINF_TIER_HOST] = t->zc.zinf.host_bytes;
    /* As the tiers round them when they open (device.c, host.c): the emulated arena in
     * 4 KiB granules, 1 GiB where no budget is given; the host tier in ZINF_ALIGN units. A
     * GPU's own budget and a daemon's job are known only once opened. */
    if (!t->remote) {
        uint64_t dev = t->zc.zinf.device_bytes, host = t->zc.zinf.host_bytes;
        if (dev || !cuda) p->capacity[ZINF_TIER_DEVICE] = align_up(dev ? dev : GiB, 4 * KiB);
        p->capacity[ZINF_TIER_HOST] = align_up(host ? host : GiB, ZINF_ALIGN);
    }
    /* Where the activation checkpoints go, as trainer_open decides it for these tiers. */
    train_act_decide(t, p->capacity);
    train_least_budgets(t, p->min_budget, p->homes, p->what);
    p->act_tier = (int)t->act_tier;
    p->act_host = train_act_host_bytes(t);
    p->derived = t->budgets;
    p->cuda = cuda;
    p->stage = t->world > 1 ? t->stage : 0;
    p->param_count = gpt_num_params(&t->cfg);
out:
    t->be = NULL;
    trainer_close(t);
    return r;
}

int trainer_plan_check(const struct trainer_plan *p, char *err, size_t errlen)
{
    if (!p || !err || !errlen) return -EINVAL;
    return train_budget_refusal(p->capacity, p->min_budget, p->homes, p->what, p->act_host, err,
                                errlen);
}

/* Whether each step's update is deferred to the next forward (trainer_opts.
 * update_in_forward): where asked, and where it would hide NVMe reads and writes behind the
 * forward with nothing else in the way: one rank of an embedded engine, on the CPU, without
 * fp16's skipped steps, the optimizer on the host with its pipeline. */
static bool update_deferrable(const struct trainer *t, bool cuda)
{
    bool nvme = train_home_of(t->zc.zero.offload_param.device) == ZINF_TIER_NVME ||
                train_home_of(t->zc.zero.offload_optimizer.device) == ZINF_TIER_NVME;
    return t->o.update_in_forward && nvme && !t->o.moe.E &&
           t->world <= 1 && !t->mp && !t->remote && !cuda && t->be->wdt != BACKEND_F16 &&
           t->opt_tier == ZINF_TIER_HOST && t->zc.zero.offload_optimizer.pipeline_read;
}

int trainer_open(const struct trainer_opts *o, struct trainer **out, char *err, size_t errlen)
{
    struct trainer *t;
    int r;
    bool cuda = false;

    *out = NULL;
    err[0] = '\0';
    if ((r = trainer_opts_check(o, err, errlen)) < 0) return r;
    if (!o->config_path || !o->data_path) {
        snprintf(err, errlen, "--config FILE and --data FILE are required");
        return -EINVAL;
    }
    if (!(t = trainer_new(o))) return -ENOMEM;
    const struct gpt_config cfg = t->cfg;
    const char *ka = getenv("ZINF_TEST_KILL_AT");
    if (ka && sscanf(ka, "%31[a-z-]:%d:%d", t->kill_point, &t->kill_rank, &t->kill_nth) != 3)
        t->kill_point[0] = 0;
    if ((r = decide(t, &cuda, err, errlen)) < 0) goto fail;
    /* The backend's working memory is taken before the engine sizes the device tier from
     * what is free. */
    /* Tensor parallel: the backend computes on this rank's slices, with the collectives of
     * its group once the ranks meet (train_pipe_setup). */
    t->tpc.tp = MAX(1, t->zc.tensor_parallel.autotp_size);
    t->tpc.rank = o->world > 1 ? o->rank % t->tpc.tp : 0;
    char tmsg[256];
    if (t->tpc.tp > 1 && gpt_tp_validate(&cfg, t->tpc.tp, t->tpc.rank, tmsg, sizeof(tmsg)) < 0) {
        snprintf(err, errlen, "tensor_parallel.autotp_size %d: %s", t->tpc.tp, tmsg);
        r = -EINVAL;
        goto fail;
    }
    t->spc.sp = MAX(1, t->zc.sequence_parallel_size);
    if (t->spc.sp > 1 && t->tpc.tp > 1) {
        snprintf(err, errlen, "tensor_parallel.autotp_size %d with sequence_parallel_size %d: "
                              "both cut the heads; use one of them", t->tpc.tp, t->spc.sp);
        r = -EINVAL;
        goto fail;
    }
    t->spc.rank = o->world > 1 ? o->rank % t->spc.sp : 0;
    if (t->spc.sp > 1 &&
        gpt_sp_check(&cfg, t->spc.sp, t->spc.rank, o->batch, o->seq, tmsg, sizeof(tmsg)) < 0) {
        snprintf(err, errlen, "sequence_parallel_size %d: %s", t->spc.sp, tmsg);
        r = -EINVAL;
        goto fail;
    }
    struct backend_params bp = {
        .cfg = cfg,
        .B = o->batch,
        .T = o->seq,
        .wdt = weight_dtype(o, cuda),
        .cuda_device = t->zc.zinf.cuda_device,
        .tp = t->tpc.tp > 1 ? &t->tpc : NULL,
        .sp = t->spc.sp > 1 && t->tpc.tp == 1 ? &t->spc : NULL,
    };
    r = cuda ? backend_cuda_open(&bp, &t->be, err, errlen)
             : backend_cpu_open(&bp, &t->be, err, errlen);
    if (r < 0) goto fail;
    t->opt_tier = optimizer_tier(t);

    if ((r = train_zero_setup(t, cuda, err, errlen)) < 0) goto fail;
    t->defer_ok = update_deferrable(t, cuda) && !o->lora.r; /* adapters follow their blocks */
    if (o->resume && !t->zc.nvme_paths.count && !t->remote) {
        snprintf(err, errlen,
                 "--resume needs an NVMe swap directory in the config "
                 "(zero_optimization.offload_param.nvme_path or zinf.nvme_paths)");
        r = -EINVAL;
        goto fail;
    }
    if ((train_home_of(t->zc.zero.offload_param.device) == ZINF_TIER_NVME ||
         train_home_of(t->zc.zero.offload_optimizer.device) == ZINF_TIER_NVME) &&
        !t->zc.nvme_paths.count && !t->remote) {
        snprintf(err, errlen, "an offload device is \"nvme\" but no nvme_path is given");
        r = -EINVAL;
        goto fail;
    }
    if ((r = train_act_mode(t, err, errlen)) < 0) goto fail;
    if ((r = load_data(t, err, errlen)) < 0) goto fail;
    /* The last tenth is held out for validation when it holds a whole sequence, and the
     * rest too: batches never come from it, whether or not anything evaluates on it. */
    t->train_bytes = t->data_bytes;
    if (t->data_bytes / HELD_OUT_DIVISOR >= (size_t)o->seq + 1)
        t->train_bytes = t->data_bytes - t->data_bytes / HELD_OUT_DIVISOR;
    /* The swap directory is the user's: a saved run there is continued (--resume) or
     * deleted on request (--overwrite), never by default. The engine refuses the same, in
     * the library's words; this says it in the command's. (The engine creates a missing
     * directory, with its parents, for a new run.) A run saved in another layout of stages
     * and ranks is found too, and re-cut into this one on --resume. */
    if (t->zc.nvme_paths.count && !t->remote && (r = train_find_saved(t, err, errlen)) < 0)
        goto fail;
    if (!t->remote && (r = train_base_open(t, err, errlen)) < 0) goto fail; /* refused */
    if (t->remote) {
        /* Through the daemon, each rank is a job of its own, JOB-rank-R-of-N, all of them in
         * the daemon's one pinned pool and swap directories. */
        if (t->world > 1)
            snprintf(t->job, sizeof(t->job), "%.40s-rank-%d-of-%d", t->o.job, t->rank, t->world);
        else
            snprintf(t->job, sizeof(t->job), "%s", t->o.job);
        r = zinf_connect(t->o.connect, t->job, &t->e);
        if (r < 0) {
            snprintf(err, errlen, "cannot connect to the zinf daemon on %s (job %s): %s",
                     t->o.connect, t->job,
                     r == -ENOENT || r == -ECONNREFUSED ? "nobody listens there (zinf serve)"
                                                        : zinf_strerror(r));
            if (r == -ENOENT) r = -ECONNREFUSED; /* a daemon not running is no bad input */
            goto fail;
        }
        if ((r = train_base_open(t, err, errlen)) < 0) goto fail;
        /* As with a swap directory: a saved run is continued or started over on request,
         * never by accident. */
        zinf_tensor st;
        bool saved = zinf_lookup(t->e, STATE_NAME, &st) == 0;
        if (o->resume && !saved) {
            snprintf(err, errlen, "--resume: job %s on %s holds no saved run%s", t->job,
                     t->o.connect,
                     t->world > 1 ? " (through the daemon, a run resumes on as many ranks as "
                                    "saved it)"
                                  : "");
            r = -ENOENT;
            goto fail;
        }
        if (!o->resume && !o->overwrite && saved) {
            snprintf(err, errlen,
                     "job %s on %s holds a saved run: continue it with --resume, "
                     "or start over with --overwrite (which deletes it)",
                     t->job, t->o.connect);
            r = -EEXIST;
            goto fail;
        }
    } else {
        unsigned flag = 0;
        /* Resuming, each rank goes to the step every rank holds: its current version, or
         * the previous one where its checkpoint of a later step was not completed by all. */
        if (t->o.resume && (t->world > 1 || t->mp) &&
            (r = train_version_flag(t->zc.nvme_paths.path[0], t->resume_step, &flag)) < 0) {
            snprintf(err, errlen, "--resume: rank %d holds no step %lld in %s", t->rank,
                     (long long)t->resume_step, t->zc.nvme_paths.path[0]);
            goto fail;
        }
        r = zinf_open_parsed(&t->zc,
                             t->o.resume                      ? ZINF_OPEN_RESUME | flag
                             : o->overwrite || t->src.N ? ZINF_OPEN_OVERWRITE
                                                              : 0,
                             &t->e);
    }
    if (r < 0) {
        if (r == -EBUSY)
            snprintf(err, errlen,
                     "%s: the swap directory %s is in use by another engine (its "
                     "swap files are locked): one job per swap directory",
                     o->config_path, t->zc.nvme_paths.count ? t->zc.nvme_paths.path[0] : "");
        else
            snprintf(err, errlen, "%s: cannot open the engine: %s", o->config_path,
                     zinf_strerror(r));
        goto fail;
    }
    if ((r = layout(t, err, errlen)) < 0 || (r = train_moe_setup(t, err, errlen)) < 0) goto fail;
    size_t bt = (size_t)o->batch * o->seq;
    t->tokens = malloc(bt * sizeof(int));
    t->targets = malloc(bt * sizeof(int));
    if (!t->tokens || !t->targets) {
        snprintf(err, errlen, "out of memory");
        r = -ENOMEM;
        goto fail;
    }
    if ((r = train_zero_alloc(t)) < 0 || (r = train_pipe_alloc(t)) < 0) {
        snprintf(err, errlen, "%s", r == -ENOMEM ? "out of memory"
                                                  : "the pipeline's stages could not agree");
        goto fail;
    }
    if ((r = train_check_budgets(t, err, errlen)) < 0) goto fail;
    /* Resuming, the saved run's shape and precision are checked before its tensors are
     * looked up, so a mismatch is named as such; without a saved state, register_all()
     * says so. */
    if (t->o.resume && zinf_lookup(t->e, STATE_NAME, &t->state) == 0 &&
        (r = train_state_check(t, err, errlen)) < 0)
        goto fail;
    if ((r = train_register_all(t, err, errlen)) < 0) goto fail;
    if (!t->o.resume && t->be->wdt == BACKEND_F16) {
        const struct trainer_fp16 *f = &o->fp16;
        loss_scale_init(&t->ls, f->loss_scale, f->initial_scale_power, f->loss_scale_window,
                        f->hysteresis, f->min_loss_scale, f->consecutive_hysteresis);
        if ((r = zinf_write(t->e, t->scaler, 0, &t->ls, sizeof(t->ls))) < 0) {
            snprintf(err, errlen, "%s: %s", SCALER_NAME, zinf_strerror(r));
            goto fail;
        }
    }
    if (t->src.N &&
        ((r = train_recut(t, err, errlen)) < 0 || (r = trainer_checkpoint(t)) < 0)) {
        if (!err[0])
            snprintf(err, errlen, "--resume: re-cutting the saved run: %s", zinf_strerror(r));
        t->checkpoint_failed = true; /* half a re-cut is never saved */
        goto fail;
    }
    if (!o->resume && ((r = train_init_params(t)) < 0 ||
                       (!o->no_start_checkpoint && (r = trainer_checkpoint(t)) < 0))) {
        snprintf(err, errlen, "initialising the parameters failed: %s%s", zinf_strerror(r),
                 r == -ENOSPC ? " (the swap directory's filesystem is full: see the line above)"
                              : "");
        t->torn = r; /* half-written weights are no run: nothing is saved */
        goto fail;
    }
    if (t->world > 1 && o->resume && (r = train_ranks_agree(t, err, errlen)) < 0) goto fail;
    t->checkpoint_step = !o->resume && o->no_start_checkpoint && !t->src.N ? -1 : t->step_done;
    *out = t;
    return 0;
fail:
    trainer_close(t);
    return r;
}

void trainer_close(struct trainer *t)
{
    if (!t) return;
    train_update_stop(t);
    /* The step count the engine holds is that of the update deferred to the next forward:
     * what of it cannot be run leaves the state torn, and the last checkpoint stays. */
    if (t->e && t->upd.pending && !t->torn) {
        int r = train_update_finish(t);
        if (r < 0) t->torn = r;
    }
    /* A torn state is dropped: the last checkpoint stays the saved one, as after a crash.
     * So it does after a failed checkpoint, as the caller was told. */
    if (t->torn || t->checkpoint_failed || ((t->world > 1 || t->mp) && !t->remote))
        zinf_close_unflushed(t->e);
    else
        zinf_close(t->e);
    train_base_close(t);
    train_pipe_close(t);
    train_moe_free(t);
    config_free(&t->zc);
    free(t->desc);
    free(t->p);
    free(t->g);
    free(t->m);
    free(t->v);
    if (t->w != t->p) free(t->w);
    free(t->block_first);
    free(t->act);
    free(t->tokens);
    free(t->targets);
    free(t->part_first);
    free(t->part);
    free(t->part_all);
    train_onebit_free(t);
    free(t->lamb_sums);
    free(t->osets);
    free(t->lamb_all);
    free(t->losses);
    if (!t->tmp_pooled) free(t->tmp);
    if (t->hcomm != t->comm) comm_close(t->hcomm);
    comm_close(t->comm);
    for (int q = 0; q < GPT_BLOCK_NSLOTS && t->be; q++) {
        t->be->ops->event_free(t->be, t->rq[q].after);
        t->be->ops->event_free(t->be, t->rq[q].done);
    }
    pthread_mutex_destroy(&t->gmu);
    pthread_mutex_destroy(&t->umu);
    pthread_cond_destroy(&t->ucv);
    pthread_cond_destroy(&t->gcv);
    for (unsigned k = 0; k < t->nbase; k++)
        free(t->base[k]);
    free(t->peer_saved);
    backend_close(t->be);
    free(t->data);
    free(t);
}

void trainer_fault_overflow(struct trainer *t)
{
    t->fault_overflow = true;
}

void trainer_fault_optimizer(struct trainer *t, int tensor, int err)
{
    t->fault_tensor = tensor;
    t->fault_err = err;
}

void trainer_fault_step_save(struct trainer *t, int err)
{
    t->fault_save_err = err;
}

void trainer_fault_optimizer_begin(struct trainer *t, void (*fn)(struct trainer *t, unsigned arg),
                                   unsigned arg)
{
    t->fault_begin = fn;
    t->fault_begin_arg = arg;
}

void trainer_get_summary(struct trainer *t, struct trainer_summary *out)
{
    struct zinf_stats st;
    *out = (struct trainer_summary){.steps_done = t->step_done,
                                    .checkpoints = t->checkpoints,
                                    .checkpoint_step = t->checkpoint_step,
                                    .checkpoint_seconds = t->checkpoint_seconds,
                                    .checkpoint_bytes = t->checkpoint_bytes,
                                    .torn = t->torn != 0,
                                    .nodes = 1};
    train_note_peaks(t);
    zinf_stats(t->e, &st);
    /* A frozen weight (LoRA) keeps its fp32 and 16-bit copies only; a trained one its gradient
     * and Adam's m and v as zinf.optimizer_state_dtype stores them too. */
    enum adamw_state_dtype sdt = (enum adamw_state_dtype)t->o.state_dtype;
    size_t w16 = t->w != t->p ? 2 : 0;
    for (int i = 0; i < t->ntensors; i++) {
        size_t n = t->desc[i].numel;
        out->param_count += n;
        if (train_frozen(t, i)) {
            out->model_state_bytes += n * (sizeof(float) + w16);
            continue;
        }
        uint64_t ms = 2 * adamw_state_bytes(sdt, n);
        out->optimizer_state_bytes += ms;
        out->model_state_bytes += n * (sizeof(float) * 2 + w16) + ms;
        out->trainable_count += n;
    }
    out->optimizer_state_dtype = adamw_state_dtype_name(sdt);
    out->backend = t->be->name;
    out->precision = t->be->wdt == BACKEND_BF16  ? "bf16"
                     : t->be->wdt == BACKEND_F16 ? "fp16"
                                                 : "fp32";
    out->skipped_steps = t->ls.skipped;
    out->loss_scale = t->be->wdt == BACKEND_F16 ? t->ls.scale : 1;
    out->backend_work_bytes = t->be->work_bytes;
    out->device_scratch_bytes = train_scratch_bytes(t);
    out->rank = t->rank;
    out->world = t->world;
    out->stage = t->stage;
    out->overlap_comm = t->overlap;
    out->reduce_seconds = (double)t->reduce_ns / 1e9;
    out->pipeline_ahead = t->opt_ahead;
    out->pipeline_refetched = t->opt_refetched;
    out->update_in_forward = t->defer_ok;
    out->have_digest = t->o.digest && t->have_digest;
    out->digest = t->digest;
    out->digest_step = t->digest_step;
    if (t->comm) {
        struct comm_stats cs;
        comm_get_stats(t->comm, &cs);
        out->comm_bytes = cs.bytes_in;
        out->grad_comm_bytes = t->grad_bytes;
        out->comm_ops = cs.ops;
        out->comm_pooled_ops = cs.pooled_ops;
        out->net_bytes_out = cs.net_bytes_out;
        out->net_bytes_in = cs.net_bytes_in;
        out->net_ops = cs.net_ops;
        out->node = cs.node;
        out->nodes = cs.nodes;
    }
    train_pipe_summary(t, out);
    out->budgets = t->budgets;
    out->min_budget[0] = t->min_budget[0];
    out->min_budget[1] = t->min_budget[1];
    out->compactions = st.compactions;
    if (!t->remote) { /* the daemon's staging and locking are its own */
        out->staging_bytes = st.host_staging_bytes;
        out->host_pinned = st.host_pinned;
    }
    for (int i = 0; i < 3; i++) {
        out->tier[i].budget_bytes = st.tier[i].capacity_bytes;
        out->tier[i].peak_bytes = t->peak[i];
    }
    train_moe_summary(t, out);
}
