/*
 * trainer.c - one training step through the engine (see trainer.h).
 *
 * A step, for a model of L blocks and a batch (B,T), w being what the device computes with
 * (the fp32 parameters p, or their bf16 copies in mixed precision):
 *   forward   a0 = embed(wte, wpe); a[k+1] = block_k(a[k])      w fetched to DEVICE
 *   head      loss, d = head_backward(a[L], lnf, wte)             grads zeroed on first touch
 *   backward  d = block_k^T(a[k], d), g_k += ...  for k = L-1..0  (block internals recomputed)
 *   embed     g_wte, g_wpe += ...
 *   optimizer for every tensor: p, g, m, v (and w) fetched to where the optimizer states
 *             live (HOST, or DEVICE when they are homed there), AdamW, all but g released
 *             dirty; the engine carries a refreshed w to the device on its next fetch.
 * Only the block inputs a[0..L] are kept between forward and backward (activation
 * checkpointing); they are zinf tensors whose home is the host tier. Gradient norms are
 * summed as each gradient is finished, so clipping needs no extra pass. The math runs in a
 * backend (backend.h): every call goes through it, whatever it computes on.
 *
 * The batch of step s is drawn from the data with a generator seeded by (seed, s), and the
 * step count is itself a zinf tensor flushed with everything else: a resumed run sees the
 * same batches and the same states, hence the same losses, as an uninterrupted one.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "engine/engine.h"
#include "tiers/cuda_probe.h"
#include "train/adamw.h"
#include "train/backend.h"
#include "train/ops.h"
#include "train/trainer.h"

#define STATE_NAME "train.state"
#define STATE_MAGIC 0x7a696e6674726e32ull /* "zinftrn2" */

/* What the state tensor holds: enough to refuse a resume with another model or data. */
struct train_state {
    uint64_t magic;
    int32_t step_done; /* steps completed */
    int32_t L, C, NH, maxT, B, T;
    int32_t wdt; /* enum backend_dtype of the device's weights */
    int32_t pad_;
    uint64_t seed;
    uint64_t data_bytes;
};

struct trainer {
    struct trainer_opts o;
    struct gpt_config cfg;
    zinf_engine *e;
    struct zinf_config zc;

    int ntensors;
    struct gpt_tensor_desc *desc;
    zinf_tensor *p, *g, *m, *v; /* by layout index: fp32 master, gradient, Adam m and v */
    zinf_tensor *w;             /* what the device computes with: p itself in fp32, else a
                                   bf16 copy that the optimizer refreshes */
    int *block_first;           /* layout index of block k's first tensor */
    int wte, wpe, lnfw, lnfb;   /* layout indices */
    zinf_tensor *act;           /* a[0..L], (B,T,C) each */
    zinf_tensor state;

    unsigned char *data;
    size_t data_bytes;
    int *tokens, *targets;      /* (B,T) */
    struct backend *be;         /* where the math runs */
    enum zinf_tier opt_tier;    /* where the optimizer runs: DEVICE or HOST */
    int step_done;
    /* A step failed while the optimizer updated the state (its -errno; 0: never): the
     * state in memory is half one step, half the next, and must never be flushed. */
    int torn;
    int checkpoints, checkpoint_step;
    bool checkpoint_failed;     /* the last trainer_checkpoint() failed */
    int fault_tensor, fault_err; /* trainer_fault_optimizer() */
    double checkpoint_seconds;
    uint64_t checkpoint_bytes;
    uint64_t peak[3];
};

void trainer_opts_defaults(struct trainer_opts *o)
{
    *o = (struct trainer_opts){.batch = 4, .seq = 64, .steps = 100, .lr = 1e-3f,
                               .weight_decay = 0.0f, .grad_clip = 1.0f, .seed = 1337};
    o->model = (struct gpt_config){.V = 256, .maxT = 64, .L = 4, .C = 128, .NH = 4};
}

int trainer_next_step(const struct trainer *t)
{
    return t->step_done + 1;
}

zinf_engine *trainer_engine(struct trainer *t)
{
    return t->e;
}

static enum zinf_tier home_of(enum config_offload_device d)
{
    return d == CONFIG_OFFLOAD_NVME ? ZINF_TIER_NVME
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
        if (fd >= 0)
            close(fd);
        return r;
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
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    if (!t->data || got != t->data_bytes) {
        snprintf(err, errlen, "%s: cannot read it whole", t->o.data_path);
        return -EIO;
    }
    return 0;
}

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The batch of step s: B windows of T+1 bytes at offsets drawn from (seed, s). */
static void load_batch(struct trainer *t, int s)
{
    int B = t->o.batch, T = t->o.seq;
    uint64_t span = t->data_bytes - (size_t)T;
    for (int b = 0; b < B; b++) {
        uint64_t off = mix64(t->o.seed * 0x9e3779b97f4a7c15ull + (uint64_t)s * 1000003u +
                             (uint64_t)b) % span;
        for (int i = 0; i < T; i++) {
            t->tokens[b * T + i] = t->data[off + (size_t)i];
            t->targets[b * T + i] = t->data[off + (size_t)i + 1];
        }
    }
}

static void note_peaks(struct trainer *t)
{
    struct zinf_stats st;
    if (zinf_stats(t->e, &st) < 0)
        return;
    for (int i = 0; i < 3; i++)
        t->peak[i] = MAX(t->peak[i], st.tier[i].peak_bytes);
}

/* How much each tier must hold at once, for a clear error before anything runs. Sizes are
 * rounded per tensor, as the tiers allocate. */
static int check_budgets(struct trainer *t, char *err, size_t errlen)
{
    struct zinf_stats st;
    size_t f = sizeof(float), wsz = backend_dtype_bytes(t->be->wdt);
    size_t act = align_up((size_t)t->o.batch * t->o.seq * t->cfg.C *
                          backend_dtype_bytes(t->be->adt), ZINF_ALIGN);
    size_t blk_n = gpt_block_num_params(&t->cfg), slack = GPT_BLOCK_NSLOTS * ZINF_ALIGN;
    size_t wte_n = (size_t)t->cfg.V * t->cfg.C;
    size_t largest = 0;
    for (int i = 0; i < t->ntensors; i++)
        largest = MAX(largest, t->desc[i].numel);
    /* One tensor's optimizer working set: p, g, m, v in fp32 and the bf16 copy. */
    size_t opt = 4 * align_up(largest * f, ZINF_ALIGN) +
                 (t->w != t->p ? align_up(largest * 2, ZINF_ALIGN) : 0);
    /* The device holds one block's weights and gradients and two activations at a time (the
     * head: wte and its gradient), and the optimizer's set when it runs there. */
    size_t dev_need = MAX(blk_n * wsz + blk_n * f + 2 * slack + 2 * act,
                          align_up(wte_n * wsz, ZINF_ALIGN) + align_up(wte_n * f, ZINF_ALIGN) +
                              2 * act);
    if (t->opt_tier == ZINF_TIER_DEVICE)
        dev_need = MAX(dev_need, opt);
    /* The host holds the activation checkpoints (their home) and, when the optimizer runs
     * there, one tensor's set. */
    size_t host_need = (size_t)(t->cfg.L + 1) * act + (t->opt_tier == ZINF_TIER_HOST ? opt : 0);

    zinf_stats(t->e, &st);
    if (st.tier[ZINF_TIER_DEVICE].capacity_bytes < dev_need) {
        char a[32], b[32];
        snprintf(err, errlen, "zinf.device_bytes: %s cannot hold one block's working set (%s: "
                 "parameters, gradients, input and output); raise it or shrink --dim/--batch/--seq",
                 format_size(st.tier[ZINF_TIER_DEVICE].capacity_bytes, a, sizeof(a)),
                 format_size(dev_need, b, sizeof(b)));
        return -EINVAL;
    }
    if (st.tier[ZINF_TIER_HOST].capacity_bytes < host_need) {
        char a[32], b[32];
        snprintf(err, errlen, "zinf.host_bytes: %s cannot hold the %d activation checkpoints "
                 "and room for one tensor's optimizer working set (%s); raise it or shrink the model/batch",
                 format_size(st.tier[ZINF_TIER_HOST].capacity_bytes, a, sizeof(a)), t->cfg.L + 1,
                 format_size(host_need, b, sizeof(b)));
        return -EINVAL;
    }
    return 0;
}

static int reg(struct trainer *t, const char *prefix, const char *name, size_t bytes,
               enum zinf_tier home, zinf_tensor *out)
{
    char full[96];
    snprintf(full, sizeof(full), "%s%s", prefix, name);
    if (t->o.resume)
        return zinf_lookup(t->e, full, out);
    return zinf_register(t->e, full, bytes, home, out);
}

static int register_all(struct trainer *t, char *err, size_t errlen)
{
    enum zinf_tier ph = home_of(t->zc.zero.offload_param.device);
    enum zinf_tier oh = home_of(t->zc.zero.offload_optimizer.device);
    size_t act = (size_t)t->o.batch * t->o.seq * t->cfg.C * backend_dtype_bytes(t->be->adt);
    bool mixed = t->w != t->p;
    char name[32];
    int r = 0;

    /* In fp32 the parameters the device computes with are the master weights, homed with
     * the parameters; in bf16 the bf16 copies are, and the fp32 masters are optimizer state. */
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        size_t bytes = t->desc[i].numel * sizeof(float);
        const char *n = t->desc[i].name;
        if ((r = reg(t, "p.", n, bytes, mixed ? oh : ph, &t->p[i])) == 0 &&
            (r = reg(t, "g.", n, bytes, oh, &t->g[i])) == 0 &&
            (r = reg(t, "m.", n, bytes, oh, &t->m[i])) == 0 &&
            (r = reg(t, "v.", n, bytes, oh, &t->v[i])) == 0 && mixed)
            r = reg(t, "w.", n, t->desc[i].numel * 2, ph, &t->w[i]);
        if (r < 0 && t->o.resume)
            snprintf(err, errlen, "--resume: tensor '%s' is not in the swap directory: is it the "
                     "saved run's, with the same model?", n);
        else if (r < 0)
            snprintf(err, errlen, "tensor '%s' (%zu bytes): %s", n, bytes, zinf_strerror(r));
    }
    for (int k = 0; k <= t->cfg.L && r == 0; k++) {
        snprintf(name, sizeof(name), "%d", k);
        /* Activations are rebuilt every step; a resumed run finds the last ones (the flush
         * keeps every tensor) and overwrites them. */
        char full[48];
        snprintf(full, sizeof(full), "act.%s", name);
        r = t->o.resume ? zinf_lookup(t->e, full, &t->act[k]) : -ENOENT;
        if (r == -ENOENT)
            r = zinf_register(t->e, full, act, ZINF_TIER_HOST, &t->act[k]);
        if (r < 0)
            snprintf(err, errlen, "activation checkpoint %d (%zu bytes) in the host tier: %s", k,
                     act, zinf_strerror(r));
    }
    if (r == 0) {
        r = reg(t, "", STATE_NAME, sizeof(struct train_state), ph, &t->state);
        if (r < 0)
            snprintf(err, errlen, "%s: %s", STATE_NAME,
                     t->o.resume ? "no training state to resume in the swap directory"
                                 : zinf_strerror(r));
    }
    return r;
}

static int init_params(struct trainer *t)
{
    float *buf = NULL;
    uint16_t *b16 = NULL;
    size_t cap = 0;
    int r = 0;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        size_t n = t->desc[i].numel;
        if (n > cap) {
            free(buf);
            free(b16);
            buf = malloc(n * sizeof(float));
            b16 = malloc(n * sizeof(uint16_t));
            cap = n;
            if (!buf || !b16) {
                r = -ENOMEM;
                break;
            }
        }
        r = gpt_init_tensor(&t->cfg, &t->desc[i], buf, t->o.seed);
        if (r == 0)
            r = zinf_write(t->e, t->p[i], 0, buf, n * sizeof(float));
        if (r == 0 && t->w != t->p) {
            ops_cast_f32_to_bf16(b16, buf, n);
            r = zinf_write(t->e, t->w[i], 0, b16, n * sizeof(uint16_t));
        }
    }
    free(buf);
    free(b16);
    return r;
}

static int state_check(struct trainer *t, char *err, size_t errlen)
{
    struct train_state s;
    int r = zinf_read(t->e, t->state, 0, &s, sizeof(s));
    if (r < 0)
        return r;
    if (s.magic != STATE_MAGIC) {
        snprintf(err, errlen, "--resume: the state in the swap directory was written by another "
                 "version of zinf train; start a new run");
        return -EINVAL;
    }
    if (s.L != t->cfg.L || s.C != t->cfg.C || s.NH != t->cfg.NH ||
        s.maxT != t->cfg.maxT || s.B != t->o.batch || s.T != t->o.seq || s.seed != t->o.seed ||
        s.data_bytes != t->data_bytes || s.wdt != (int32_t)t->be->wdt) {
        snprintf(err, errlen, "--resume: the saved run used --layers %d --dim %d --heads %d "
                 "--seq %d --batch %d --seed %llu --precision %s on %llu bytes of data; give "
                 "the same", s.L, s.C, s.NH, s.T, s.B, (unsigned long long)s.seed,
                 s.wdt == BACKEND_BF16 ? "bf16" : "fp32", (unsigned long long)s.data_bytes);
        return -EINVAL;
    }
    t->step_done = s.step_done;
    return 0;
}

static int state_save_step(struct trainer *t, int step_done)
{
    struct train_state s = {.magic = STATE_MAGIC, .step_done = step_done, .L = t->cfg.L,
                            .C = t->cfg.C, .NH = t->cfg.NH, .maxT = t->cfg.maxT,
                            .B = t->o.batch, .T = t->o.seq, .seed = t->o.seed,
                            .data_bytes = t->data_bytes, .wdt = (int32_t)t->be->wdt};
    return zinf_write(t->e, t->state, 0, &s, sizeof(s));
}

static int state_save(struct trainer *t)
{
    return state_save_step(t, t->step_done);
}

int trainer_open(const struct trainer_opts *o, struct trainer **out, char *err, size_t errlen)
{
    struct trainer *t;
    int r;

    *out = NULL;
    err[0] = '\0';
    if (o->model.V != 256) {
        snprintf(err, errlen, "the vocabulary is bytes: V must be 256");
        return -EINVAL;
    }
    if (o->batch < 1 || o->seq < 1 || o->steps < 0 || !(o->lr >= 0) || !(o->grad_clip >= 0)) {
        snprintf(err, errlen, "--batch and --seq must be >= 1, --steps >= 0, --lr >= 0");
        return -EINVAL;
    }
    struct gpt_config cfg = o->model;
    cfg.maxT = o->seq;
    if (gpt_config_validate(&cfg, err, errlen) < 0)
        return -EINVAL;
    if (!o->config_path || !o->data_path) {
        snprintf(err, errlen, "--config FILE and --data FILE are required");
        return -EINVAL;
    }

    t = calloc(1, sizeof(*t));
    if (!t)
        return -ENOMEM;
    t->o = *o;
    t->cfg = cfg;
    config_defaults(&t->zc);
    if ((r = config_parse_file(o->config_path, &t->zc, err, errlen)) < 0)
        goto fail;
    /* The device tier and the backend go together: the CUDA kernels where the tier is a
     * GPU, the CPU over the emulated tier otherwise. */
    bool cuda = false;
    if (t->zc.zinf.device != ZINF_DEVICE_EMULATED) {
        struct cuda_probe_info ci = {0};
        bool built = backend_cuda_built(), usable = built && cuda_probe(&ci) > 0;
        if (t->zc.zinf.device == ZINF_DEVICE_CUDA && !usable) {
            snprintf(err, errlen, "zinf.device is \"cuda\" but %s; use \"auto\" or \"emulated\"",
                     !built ? "this build has no CUDA kernels (no CUDA toolkit when it was built)"
                            : ci.reason[0] ? ci.reason : "no GPU is usable");
            r = -ENODEV;
            goto fail;
        }
        cuda = usable;
    }
    t->zc.zinf.device = cuda ? ZINF_DEVICE_CUDA : ZINF_DEVICE_EMULATED;
    /* The backend's working memory is taken before the engine sizes the device tier from
     * what is free. */
    struct backend_params bp = {
        .cfg = cfg,
        .B = o->batch,
        .T = o->seq,
        .wdt = o->precision == TRAINER_PRECISION_BF16   ? BACKEND_BF16
               : o->precision == TRAINER_PRECISION_FP32 ? BACKEND_F32
               : cuda                                   ? BACKEND_BF16
                                                        : BACKEND_F32,
        .cuda_device = t->zc.zinf.cuda_device,
    };
    r = cuda ? backend_cuda_open(&bp, &t->be, err, errlen)
             : backend_cpu_open(&bp, &t->be, err, errlen);
    if (r < 0)
        goto fail;
    t->opt_tier = home_of(t->zc.zero.offload_optimizer.device) == ZINF_TIER_DEVICE
                      ? ZINF_TIER_DEVICE
                      : ZINF_TIER_HOST;
    if (o->resume && !t->zc.nvme_paths.count) {
        snprintf(err, errlen, "--resume needs an NVMe swap directory in the config "
                 "(zero_optimization.offload_param.nvme_path or zinf.nvme_paths)");
        r = -EINVAL;
        goto fail;
    }
    if ((home_of(t->zc.zero.offload_param.device) == ZINF_TIER_NVME ||
         home_of(t->zc.zero.offload_optimizer.device) == ZINF_TIER_NVME) &&
        !t->zc.nvme_paths.count) {
        snprintf(err, errlen, "an offload device is \"nvme\" but no nvme_path is given");
        r = -EINVAL;
        goto fail;
    }
    if ((r = load_data(t, err, errlen)) < 0)
        goto fail;
    /* The swap directory is the user's: a saved run there is continued (--resume) or
     * deleted on request (--overwrite), never by default. The engine refuses the same, in
     * the library's words; this says it in the command's. (The engine creates a missing
     * directory, with its parents, for a new run.) */
    if (t->zc.nvme_paths.count) {
        const char *sd = t->zc.nvme_paths.path[0];
        size_t n = 0;
        int pr = persist_probe(sd, &n, NULL);
        if (o->resume && pr == -ENOENT) {
            snprintf(err, errlen, "--resume: no saved run in %s", sd);
            r = -ENOENT;
            goto fail;
        }
        if (!o->resume && !o->overwrite && pr == 0 && n > 0) {
            snprintf(err, errlen, "%s holds a saved run: continue it with --resume, or start "
                     "over with --overwrite (which deletes it)", sd);
            r = -EEXIST;
            goto fail;
        }
    }

    r = engine_open_config(&t->zc, o->resume      ? ZINF_OPEN_RESUME
                                   : o->overwrite ? ZINF_OPEN_OVERWRITE
                                                  : 0,
                           &t->e);
    if (r < 0) {
        snprintf(err, errlen, "%s: cannot open the engine: %s", o->config_path, zinf_strerror(r));
        goto fail;
    }
    t->ntensors = gpt_layout(&cfg, NULL, 0);
    t->desc = calloc((size_t)t->ntensors, sizeof(*t->desc));
    t->p = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->g = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->m = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->v = calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->w = t->be->wdt == BACKEND_F32 ? t->p : calloc((size_t)t->ntensors, sizeof(zinf_tensor));
    t->block_first = calloc((size_t)cfg.L, sizeof(int));
    t->act = calloc((size_t)cfg.L + 1, sizeof(zinf_tensor));
    size_t bt = (size_t)o->batch * o->seq;
    t->tokens = malloc(bt * sizeof(int));
    t->targets = malloc(bt * sizeof(int));
    if (!t->desc || !t->p || !t->g || !t->m || !t->v || !t->w || !t->block_first || !t->act ||
        !t->tokens || !t->targets) {
        snprintf(err, errlen, "out of memory");
        r = -ENOMEM;
        goto fail;
    }
    gpt_layout(&cfg, t->desc, (size_t)t->ntensors);
    for (int i = 0; i < t->ntensors; i++) {
        const struct gpt_tensor_desc *d = &t->desc[i];
        if (d->block >= 0 && d->slot == 0)
            t->block_first[d->block] = i;
        if (d->block < 0) {
            if (d->slot == GPT_WTE)
                t->wte = i;
            else if (d->slot == GPT_WPE)
                t->wpe = i;
            else if (d->slot == GPT_LNF_W)
                t->lnfw = i;
            else
                t->lnfb = i;
        }
    }
    if ((r = check_budgets(t, err, errlen)) < 0)
        goto fail;
    /* Resuming, the saved run's shape and precision are checked before its tensors are
     * looked up, so a mismatch is named as such; without a saved state, register_all()
     * says so. */
    if (o->resume && zinf_lookup(t->e, STATE_NAME, &t->state) == 0 &&
        (r = state_check(t, err, errlen)) < 0)
        goto fail;
    if ((r = register_all(t, err, errlen)) < 0)
        goto fail;
    if (!o->resume && ((r = init_params(t)) < 0 || (r = trainer_checkpoint(t)) < 0)) {
        snprintf(err, errlen, "initialising the parameters failed: %s%s", zinf_strerror(r),
                 r == -ENOSPC ? " (the swap directory's filesystem is full: see the line above)"
                              : "");
        goto fail;
    }
    t->checkpoint_step = t->step_done;
    *out = t;
    return 0;
fail:
    trainer_close(t);
    return r;
}

void trainer_close(struct trainer *t)
{
    if (!t)
        return;
    /* A torn state is dropped: the last checkpoint stays the saved one, as after a crash.
     * So it does after a failed checkpoint, as the caller was told. */
    if (t->torn || t->checkpoint_failed)
        engine_close_unflushed(t->e);
    else
        zinf_close(t->e);
    config_free(&t->zc);
    free(t->desc);
    free(t->p);
    free(t->g);
    free(t->m);
    free(t->v);
    if (t->w != t->p)
        free(t->w);
    free(t->block_first);
    free(t->act);
    free(t->tokens);
    free(t->targets);
    backend_close(t->be);
    free(t->data);
    free(t);
}

/* ---- one step -------------------------------------------------------------------------- */

#define TRY(x)                                                                                 \
    do {                                                                                       \
        if ((r = (x)) < 0)                                                                     \
            goto out;                                                                          \
    } while (0)

static int fetch(struct trainer *t, zinf_tensor h, enum zinf_tier tier, void **p)
{
    return zinf_fetch(t->e, h, tier, p);
}

/* Fetch one block's 12 tensors of hs to tier. On failure the ones already fetched are
 * released. */
static int fetch_block(struct trainer *t, const zinf_tensor *hs, int k, enum zinf_tier tier,
                       void **ptrs)
{
    int first = t->block_first[k], r = 0, i;
    for (i = 0; i < GPT_BLOCK_NSLOTS; i++)
        if ((r = fetch(t, hs[first + i], tier, &ptrs[i])) < 0)
            break;
    if (r < 0)
        while (i-- > 0)
            zinf_release(t->e, hs[first + i], tier, 0);
    return r;
}

static int release_block(struct trainer *t, const zinf_tensor *hs, int k, enum zinf_tier tier,
                         unsigned flags)
{
    int first = t->block_first[k], r = 0;
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++) {
        int x = zinf_release(t->e, hs[first + i], tier, flags);
        if (x < 0 && r == 0)
            r = x;
    }
    return r;
}

/* The backend's queued work that reads or writes what is about to be released must be
 * done first; when it failed, r keeps the first error. */
static int settle(struct trainer *t, int r)
{
    int x = t->be->ops->sync(t->be);
    return r < 0 ? r : x;
}

static int forward(struct trainer *t)
{
    const struct backend_ops *be = t->be->ops;
    int r;
    void *wte, *wpe, *a, *b, *w[GPT_BLOCK_NSLOTS];

    TRY(fetch(t, t->w[t->wte], ZINF_TIER_DEVICE, &wte));
    if ((r = fetch(t, t->w[t->wpe], ZINF_TIER_DEVICE, &wpe)) < 0) {
        zinf_release(t->e, t->w[t->wte], ZINF_TIER_DEVICE, 0);
        goto out;
    }
    if ((r = fetch(t, t->act[0], ZINF_TIER_DEVICE, &a)) == 0) {
        r = settle(t, be->embed_forward(t->be, wte, wpe, a));
        zinf_release(t->e, t->act[0], ZINF_TIER_DEVICE, r == 0 ? ZINF_RELEASE_DIRTY : 0);
    }
    zinf_release(t->e, t->w[t->wpe], ZINF_TIER_DEVICE, 0);
    zinf_release(t->e, t->w[t->wte], ZINF_TIER_DEVICE, 0);
    if (r < 0)
        goto out;

    for (int k = 0; k < t->cfg.L; k++) {
        TRY(fetch_block(t, t->w, k, ZINF_TIER_DEVICE, w));
        if ((r = fetch(t, t->act[k], ZINF_TIER_DEVICE, &a)) == 0) {
            if ((r = fetch(t, t->act[k + 1], ZINF_TIER_DEVICE, &b)) == 0) {
                r = settle(t, be->block_forward(t->be, (const void *const *)w, a, b));
                zinf_release(t->e, t->act[k + 1], ZINF_TIER_DEVICE,
                             r == 0 ? ZINF_RELEASE_DIRTY : 0);
            }
            zinf_release(t->e, t->act[k], ZINF_TIER_DEVICE, 0);
        }
        release_block(t, t->w, k, ZINF_TIER_DEVICE, 0);
        if (r < 0)
            goto out;
        note_peaks(t);
    }
out:
    return r;
}

/* The head's backward gives the loss and the first gradient; gradients are zeroed on
 * their first touch of the step. */
static int head(struct trainer *t)
{
    const struct gpt_config *c = &t->cfg;
    const struct backend_ops *be = t->be->ops;
    int r = 0;
    zinf_tensor hs[7] = {t->act[c->L], t->w[t->lnfw], t->w[t->lnfb], t->w[t->wte],
                         t->g[t->lnfw], t->g[t->lnfb], t->g[t->wte]};
    void *p[7];
    int n;

    for (n = 0; n < 7; n++)
        if ((r = fetch(t, hs[n], ZINF_TIER_DEVICE, &p[n])) < 0)
            break;
    if (r == 0) {
        size_t C = (size_t)c->C * sizeof(float);
        if ((r = be->zero(t->be, p[4], C)) == 0 && (r = be->zero(t->be, p[5], C)) == 0 &&
            (r = be->zero(t->be, p[6], (size_t)c->V * C)) == 0 &&
            (r = be->head_backward(t->be, p[1], p[2], p[3], p[0], p[4], p[5], p[6])) == 0 &&
            (r = be->sumsq(t->be, p[4], (size_t)c->C)) == 0)
            r = be->sumsq(t->be, p[5], (size_t)c->C);
    }
    r = settle(t, r);
    while (n-- > 0)
        zinf_release(t->e, hs[n], ZINF_TIER_DEVICE, n >= 4 && r == 0 ? ZINF_RELEASE_DIRTY : 0);
    return r;
}

static int backward(struct trainer *t)
{
    const struct backend_ops *be = t->be->ops;
    int r = 0;
    void *w[GPT_BLOCK_NSLOTS], *gw[GPT_BLOCK_NSLOTS], *a;

    for (int k = t->cfg.L - 1; k >= 0; k--) {
        TRY(fetch_block(t, t->w, k, ZINF_TIER_DEVICE, w));
        if ((r = fetch_block(t, t->g, k, ZINF_TIER_DEVICE, gw)) < 0) {
            release_block(t, t->w, k, ZINF_TIER_DEVICE, 0);
            goto out;
        }
        for (int i = 0; i < GPT_BLOCK_NSLOTS && r == 0; i++)
            r = be->zero(t->be, gw[i], t->desc[t->block_first[k] + i].numel * sizeof(float));
        if (r == 0 && (r = fetch(t, t->act[k], ZINF_TIER_DEVICE, &a)) == 0) {
            r = be->block_backward(t->be, (const void *const *)w, a, (float *const *)gw);
            for (int i = 0; i < GPT_BLOCK_NSLOTS && r == 0; i++)
                r = be->sumsq(t->be, gw[i], t->desc[t->block_first[k] + i].numel);
            r = settle(t, r);
            zinf_release(t->e, t->act[k], ZINF_TIER_DEVICE, 0);
        } else {
            r = settle(t, r);
        }
        release_block(t, t->g, k, ZINF_TIER_DEVICE, r == 0 ? ZINF_RELEASE_DIRTY : 0);
        release_block(t, t->w, k, ZINF_TIER_DEVICE, 0);
        if (r < 0)
            goto out;
        note_peaks(t);
    }

    /* The embeddings: g_wte already holds the head's share. */
    void *gwte, *gwpe;
    TRY(fetch(t, t->g[t->wte], ZINF_TIER_DEVICE, &gwte));
    if ((r = fetch(t, t->g[t->wpe], ZINF_TIER_DEVICE, &gwpe)) == 0) {
        if ((r = be->zero(t->be, gwpe, t->desc[t->wpe].numel * sizeof(float))) == 0 &&
            (r = be->embed_backward(t->be, gwte, gwpe)) == 0 &&
            (r = be->sumsq(t->be, gwte, t->desc[t->wte].numel)) == 0)
            r = be->sumsq(t->be, gwpe, t->desc[t->wpe].numel);
        r = settle(t, r);
        zinf_release(t->e, t->g[t->wpe], ZINF_TIER_DEVICE, r == 0 ? ZINF_RELEASE_DIRTY : 0);
    }
    zinf_release(t->e, t->g[t->wte], ZINF_TIER_DEVICE, r == 0 ? ZINF_RELEASE_DIRTY : 0);
out:
    return r;
}

/* AdamW over every tensor where the optimizer's states live: on the device with the
 * backend's fused kernel when they are homed there, else on the host. With bf16 weights the
 * update writes the bf16 copy too (released dirty: the engine carries it to the device on
 * its next fetch there). The learned schedule prefetches the next tensor's parts while this
 * one is updated. */
static int optimize(struct trainer *t, int step, double sumsq)
{
    struct adamw_hparams h;
    float scale = adamw_clip_scale(sumsq, t->o.grad_clip);
    enum zinf_tier tier = t->opt_tier;
    bool mixed = t->w != t->p;
    int r = 0;

    adamw_hparams_defaults(&h);
    h.lr = t->o.lr;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        zinf_tensor hs[5] = {t->p[i], t->g[i], t->m[i], t->v[i], t->w[i]};
        int parts = mixed ? 5 : 4, n;
        void *p[5] = {NULL};
        for (n = 0; n < parts; n++)
            if ((r = fetch(t, hs[n], tier, &p[n])) < 0)
                break;
        if (r == 0 && t->fault_err && i == t->fault_tensor) {
            r = -t->fault_err; /* as if the last fetch had failed */
            t->fault_err = 0;
        }
        if (r == 0) {
            /* Decay the matrices only, as GPT-2 trainers do (not biases, norms). */
            h.weight_decay = t->desc[i].ndim == 2 ? t->o.weight_decay : 0.0f;
            if (tier == ZINF_TIER_DEVICE)
                r = settle(t, t->be->ops->adamw(t->be, p[0], p[1], p[2], p[3], p[4],
                                                t->desc[i].numel, &h, step, scale));
            else if (mixed)
                r = adamw_update_bf16(p[0], p[1], p[2], p[3], p[4], t->desc[i].numel, &h, step,
                                      scale);
            else
                r = adamw_update(p[0], p[1], p[2], p[3], t->desc[i].numel, &h, step, scale);
        }
        while (n-- > 0)
            zinf_release(t->e, hs[n], tier, n != 1 && r == 0 ? ZINF_RELEASE_DIRTY : 0);
        note_peaks(t);
    }
    return r;
}

int trainer_step(struct trainer *t, struct trainer_step_stats *st)
{
    struct zinf_stats s0, s1;
    int step = t->step_done + 1, r;
    float loss = 0;
    double sumsq = 0;

    if (t->torn)
        return t->torn;
    zinf_stats(t->e, &s0);
    uint64_t t0 = now_ns();
    load_batch(t, step);
    TRY(t->be->ops->set_batch(t->be, t->tokens, t->targets));
    TRY(forward(t));
    TRY(head(t));
    TRY(backward(t));
    TRY(t->be->ops->collect(t->be, &loss, &sumsq));
    /* Up to here only gradients and activations changed, which the next step rebuilds;
     * from here the parameters and Adam states change, tensor by tensor, until the step
     * count says they belong to this step. */
    if ((r = optimize(t, step, sumsq)) < 0 || (r = state_save_step(t, step)) < 0) {
        t->torn = r;
        goto out;
    }
    t->step_done = step;
    TRY(zinf_step(t->e));
    double sec = (double)(now_ns() - t0) / 1e9;
    zinf_stats(t->e, &s1);
    *st = (struct trainer_step_stats){
        .step = step,
        .loss = loss,
        .seconds = sec,
        .tokens_per_s = (double)t->o.batch * t->o.seq / sec,
        .nvme_read_GBps = (double)(s1.nvme_bytes_read - s0.nvme_bytes_read) / sec / 1e9,
        .nvme_write_GBps = (double)(s1.nvme_bytes_written - s0.nvme_bytes_written) / sec / 1e9,
        .blocked_fraction = (double)(s1.blocked_ns - s0.blocked_ns) / 1e9 / sec,
    };
out:
    if (r < 0) {
        /* A failed step leaves no half-summed norm behind for the next one. */
        float l;
        double d;
        t->be->ops->collect(t->be, &l, &d);
    }
    return r;
}

int trainer_checkpoint(struct trainer *t)
{
    struct zinf_stats s0, s1;
    if (t->torn)
        return t->torn;
    zinf_stats(t->e, &s0);
    uint64_t t0 = now_ns();
    int r = state_save(t);
    if (r == 0)
        r = zinf_flush(t->e);
    t->checkpoint_failed = r < 0;
    if (r < 0)
        return r;
    zinf_stats(t->e, &s1);
    t->checkpoints++;
    t->checkpoint_step = t->step_done;
    t->checkpoint_seconds = (double)(now_ns() - t0) / 1e9;
    t->checkpoint_bytes = s1.nvme_bytes_written - s0.nvme_bytes_written;
    return 0;
}

void trainer_fault_optimizer(struct trainer *t, int tensor, int err)
{
    t->fault_tensor = tensor;
    t->fault_err = err;
}

void trainer_get_summary(struct trainer *t, struct trainer_summary *out)
{
    struct zinf_stats st;
    *out = (struct trainer_summary){.steps_done = t->step_done,
                                    .checkpoints = t->checkpoints,
                                    .checkpoint_step = t->checkpoint_step,
                                    .checkpoint_seconds = t->checkpoint_seconds,
                                    .checkpoint_bytes = t->checkpoint_bytes,
                                    .torn = t->torn != 0};
    note_peaks(t);
    zinf_stats(t->e, &st);
    for (int i = 0; i < t->ntensors; i++)
        out->param_count += t->desc[i].numel;
    out->model_state_bytes = out->param_count * (sizeof(float) * 4 + (t->w != t->p ? 2 : 0));
    out->backend = t->be->name;
    out->precision = t->be->wdt == BACKEND_BF16 ? "bf16" : "fp32";
    out->backend_work_bytes = t->be->work_bytes;
    for (int i = 0; i < 3; i++) {
        out->tier[i].budget_bytes = st.tier[i].capacity_bytes;
        out->tier[i].peak_bytes = t->peak[i];
    }
}
