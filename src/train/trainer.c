/*
 * trainer.c - one training step through the engine (see trainer.h).
 *
 * A step, for a model of L blocks and a batch (B,T):
 *   forward   a0 = embed(wte, wpe); a[k+1] = block_k(a[k])      params fetched to DEVICE
 *   head      loss, d = head_backward(a[L], lnf, wte)             grads zeroed on first touch
 *   backward  d = block_k^T(a[k], d), g_k += ...  for k = L-1..0  (block internals recomputed)
 *   embed     g_wte, g_wpe += ...
 *   optimizer for every tensor: p, g, m, v fetched to HOST, AdamW, p m v released dirty
 * Only the block inputs a[0..L] are kept between forward and backward (activation
 * checkpointing); they are zinf tensors whose home is the host tier. Gradient norms are
 * summed as each gradient is finished, so clipping needs no extra pass.
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
#include "train/adamw.h"
#include "train/trainer.h"

#define STATE_NAME "train.state"
#define STATE_MAGIC 0x7a696e6674726e31ull /* "zinftrn1" */

/* What the state tensor holds: enough to refuse a resume with another model or data. */
struct train_state {
    uint64_t magic;
    int32_t step_done; /* steps completed */
    int32_t L, C, NH, maxT, B, T;
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
    zinf_tensor *p, *g, *m, *v; /* by layout index */
    int *block_first;           /* layout index of block k's first tensor */
    int wte, wpe, lnfw, lnfb;   /* layout indices */
    zinf_tensor *act;           /* a[0..L], (B,T,C) each */
    zinf_tensor state;

    unsigned char *data;
    size_t data_bytes;
    int *tokens, *targets;      /* (B,T) */
    float *dx;                  /* (B,T,C): the gradient flowing back through the blocks */
    struct gpt_scratch scratch;
    double sumsq;               /* of this step's gradients */
    int step_done;
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

/* How much each tier must hold at once, for a clear error before anything runs. */
static int check_budgets(struct trainer *t, char *err, size_t errlen)
{
    struct zinf_stats st;
    size_t f = sizeof(float);
    size_t act = (size_t)t->o.batch * t->o.seq * t->cfg.C * f;
    size_t blk = gpt_block_num_params(&t->cfg) * f;
    size_t wte = (size_t)t->cfg.V * t->cfg.C * f;
    size_t largest = 0;
    for (int i = 0; i < t->ntensors; i++)
        largest = MAX(largest, align_up(t->desc[i].numel * f, ZINF_ALIGN));
    /* The device holds one block's parameters and gradients and two activations at a
     * time (the head: wte and its gradient). Rounded per tensor, as the tiers allocate. */
    size_t dev_need = MAX(2 * (blk + GPT_BLOCK_NSLOTS * ZINF_ALIGN) + 2 * align_up(act, ZINF_ALIGN),
                          2 * align_up(wte, ZINF_ALIGN) + 2 * align_up(act, ZINF_ALIGN));
    /* The host holds the activation checkpoints (their home) and one tensor's p, g, m, v. */
    size_t host_need = (size_t)(t->cfg.L + 1) * align_up(act, ZINF_ALIGN) + 4 * largest;

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
    size_t act = (size_t)t->o.batch * t->o.seq * t->cfg.C * sizeof(float);
    char name[32];
    int r = 0;

    for (int i = 0; i < t->ntensors && r == 0; i++) {
        size_t bytes = t->desc[i].numel * sizeof(float);
        const char *n = t->desc[i].name;
        if ((r = reg(t, "p.", n, bytes, ph, &t->p[i])) == 0 &&
            (r = reg(t, "g.", n, bytes, oh, &t->g[i])) == 0 &&
            (r = reg(t, "m.", n, bytes, oh, &t->m[i])) == 0)
            r = reg(t, "v.", n, bytes, oh, &t->v[i]);
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
    size_t cap = 0;
    int r = 0;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        size_t bytes = t->desc[i].numel * sizeof(float);
        if (bytes > cap) {
            free(buf);
            buf = malloc(bytes);
            cap = bytes;
            if (!buf)
                return -ENOMEM;
        }
        r = gpt_init_tensor(&t->cfg, &t->desc[i], buf, t->o.seed);
        if (r == 0)
            r = zinf_write(t->e, t->p[i], 0, buf, bytes);
    }
    free(buf);
    return r;
}

static int state_check(struct trainer *t, char *err, size_t errlen)
{
    struct train_state s;
    int r = zinf_read(t->e, t->state, 0, &s, sizeof(s));
    if (r < 0)
        return r;
    if (s.magic != STATE_MAGIC || s.L != t->cfg.L || s.C != t->cfg.C || s.NH != t->cfg.NH ||
        s.maxT != t->cfg.maxT || s.B != t->o.batch || s.T != t->o.seq || s.seed != t->o.seed ||
        s.data_bytes != t->data_bytes) {
        snprintf(err, errlen, "--resume: the saved run used --layers %d --dim %d --heads %d "
                 "--seq %d --batch %d --seed %llu on %llu bytes of data; give the same",
                 s.L, s.C, s.NH, s.T, s.B, (unsigned long long)s.seed,
                 (unsigned long long)s.data_bytes);
        return -EINVAL;
    }
    t->step_done = s.step_done;
    return 0;
}

static int state_save(struct trainer *t)
{
    struct train_state s = {.magic = STATE_MAGIC, .step_done = t->step_done, .L = t->cfg.L,
                            .C = t->cfg.C, .NH = t->cfg.NH, .maxT = t->cfg.maxT,
                            .B = t->o.batch, .T = t->o.seq, .seed = t->o.seed,
                            .data_bytes = t->data_bytes};
    return zinf_write(t->e, t->state, 0, &s, sizeof(s));
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
    /* This trainer computes on the CPU, through the pointers the device tier hands out:
     * they must be host memory, so the device tier is the emulated one. */
    if (t->zc.zinf.device == ZINF_DEVICE_CUDA) {
        snprintf(err, errlen, "zinf.device: \"cuda\" is not supported by the CPU trainer; use "
                 "\"auto\" or \"emulated\" (the device budget is then held in host memory)");
        r = -EINVAL;
        goto fail;
    }
    t->zc.zinf.device = ZINF_DEVICE_EMULATED;
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
    /* A swap directory named in the config is created when missing (its parent must exist). */
    for (unsigned i = 0; i < t->zc.nvme_paths.count; i++) {
        if (mkdir(t->zc.nvme_paths.path[i], 0755) < 0 && errno != EEXIST) {
            r = -errno;
            snprintf(err, errlen, "nvme_path %s: %s", t->zc.nvme_paths.path[i], strerror(errno));
            goto fail;
        }
    }

    r = engine_open_config(&t->zc, o->resume ? ZINF_OPEN_RESUME : 0, &t->e);
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
    t->block_first = calloc((size_t)cfg.L, sizeof(int));
    t->act = calloc((size_t)cfg.L + 1, sizeof(zinf_tensor));
    size_t bt = (size_t)o->batch * o->seq;
    t->tokens = malloc(bt * sizeof(int));
    t->targets = malloc(bt * sizeof(int));
    t->dx = malloc(bt * cfg.C * sizeof(float));
    t->scratch.bytes = gpt_scratch_bytes(&cfg, o->batch, o->seq);
    t->scratch.mem = malloc(t->scratch.bytes);
    if (!t->desc || !t->p || !t->g || !t->m || !t->v || !t->block_first || !t->act ||
        !t->tokens || !t->targets || !t->dx || !t->scratch.mem) {
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
    if ((r = register_all(t, err, errlen)) < 0)
        goto fail;
    if (o->resume) {
        if ((r = state_check(t, err, errlen)) < 0)
            goto fail;
    } else if ((r = init_params(t)) < 0 || (r = state_save(t)) < 0) {
        snprintf(err, errlen, "initialising the parameters failed: %s", zinf_strerror(r));
        goto fail;
    }
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
    zinf_close(t->e);
    config_free(&t->zc);
    free(t->desc);
    free(t->p);
    free(t->g);
    free(t->m);
    free(t->v);
    free(t->block_first);
    free(t->act);
    free(t->tokens);
    free(t->targets);
    free(t->dx);
    free(t->scratch.mem);
    free(t->data);
    free(t);
}

/* ---- one step -------------------------------------------------------------------------- */

#define TRY(x)                                                                                 \
    do {                                                                                       \
        if ((r = (x)) < 0)                                                                     \
            goto out;                                                                          \
    } while (0)

static int fetch(struct trainer *t, zinf_tensor h, enum zinf_tier tier, float **p)
{
    return zinf_fetch(t->e, h, tier, (void **)p);
}

/* Fetch one block's 12 parameter tensors (or gradient tensors) to tier. On failure the
 * ones already fetched are released. */
static int fetch_block(struct trainer *t, const zinf_tensor *hs, int k, enum zinf_tier tier,
                       float **ptrs)
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

static int add_sumsq(struct trainer *t, const float *g, size_t n)
{
    double s;
    int r = adamw_sum_squares(g, n, &s);
    if (r == 0)
        t->sumsq += s;
    return r;
}

static int forward(struct trainer *t)
{
    const struct gpt_config *c = &t->cfg;
    int B = t->o.batch, T = t->o.seq, r;
    float *wte, *wpe, *a, *b, *w[GPT_BLOCK_NSLOTS];

    TRY(fetch(t, t->p[t->wte], ZINF_TIER_DEVICE, &wte));
    if ((r = fetch(t, t->p[t->wpe], ZINF_TIER_DEVICE, &wpe)) < 0) {
        zinf_release(t->e, t->p[t->wte], ZINF_TIER_DEVICE, 0);
        goto out;
    }
    if ((r = fetch(t, t->act[0], ZINF_TIER_DEVICE, &a)) == 0) {
        r = gpt_embed_forward(c, B, T, wte, wpe, t->tokens, a);
        zinf_release(t->e, t->act[0], ZINF_TIER_DEVICE, r == 0 ? ZINF_RELEASE_DIRTY : 0);
    }
    zinf_release(t->e, t->p[t->wpe], ZINF_TIER_DEVICE, 0);
    zinf_release(t->e, t->p[t->wte], ZINF_TIER_DEVICE, 0);
    if (r < 0)
        goto out;

    for (int k = 0; k < c->L; k++) {
        struct gpt_block_params bp;
        TRY(fetch_block(t, t->p, k, ZINF_TIER_DEVICE, w));
        for (int i = 0; i < GPT_BLOCK_NSLOTS; i++)
            bp.t[i] = w[i];
        if ((r = fetch(t, t->act[k], ZINF_TIER_DEVICE, &a)) == 0) {
            if ((r = fetch(t, t->act[k + 1], ZINF_TIER_DEVICE, &b)) == 0) {
                r = gpt_block_forward(c, B, T, &bp, a, b, &t->scratch);
                zinf_release(t->e, t->act[k + 1], ZINF_TIER_DEVICE,
                             r == 0 ? ZINF_RELEASE_DIRTY : 0);
            }
            zinf_release(t->e, t->act[k], ZINF_TIER_DEVICE, 0);
        }
        release_block(t, t->p, k, ZINF_TIER_DEVICE, 0);
        if (r < 0)
            goto out;
        note_peaks(t);
    }
out:
    return r;
}

/* The head's backward gives the loss and the first gradient; gradients are zeroed on
 * their first touch of the step. */
static int head(struct trainer *t, float *loss)
{
    const struct gpt_config *c = &t->cfg;
    int B = t->o.batch, T = t->o.seq, r;
    zinf_tensor hs[7] = {t->act[c->L], t->p[t->lnfw], t->p[t->lnfb], t->p[t->wte],
                         t->g[t->lnfw], t->g[t->lnfb], t->g[t->wte]};
    float *p[7];
    int n;

    for (n = 0; n < 7; n++)
        if ((r = fetch(t, hs[n], ZINF_TIER_DEVICE, &p[n])) < 0)
            break;
    if (r == 0) {
        memset(p[4], 0, (size_t)c->C * sizeof(float));
        memset(p[5], 0, (size_t)c->C * sizeof(float));
        memset(p[6], 0, (size_t)c->V * c->C * sizeof(float));
        r = gpt_head_backward(c, B, T, p[1], p[2], p[3], p[0], t->targets, t->dx, p[4], p[5],
                              p[6], loss, &t->scratch);
        if (r == 0)
            r = add_sumsq(t, p[4], (size_t)c->C);
        if (r == 0)
            r = add_sumsq(t, p[5], (size_t)c->C);
    }
    while (n-- > 0)
        zinf_release(t->e, hs[n], ZINF_TIER_DEVICE, n >= 4 && r == 0 ? ZINF_RELEASE_DIRTY : 0);
    return r;
}

static int backward(struct trainer *t)
{
    const struct gpt_config *c = &t->cfg;
    int B = t->o.batch, T = t->o.seq, r = 0;
    float *w[GPT_BLOCK_NSLOTS], *gw[GPT_BLOCK_NSLOTS], *a;

    for (int k = c->L - 1; k >= 0; k--) {
        struct gpt_block_params bp;
        struct gpt_block_grads bg;
        TRY(fetch_block(t, t->p, k, ZINF_TIER_DEVICE, w));
        if ((r = fetch_block(t, t->g, k, ZINF_TIER_DEVICE, gw)) < 0) {
            release_block(t, t->p, k, ZINF_TIER_DEVICE, 0);
            goto out;
        }
        for (int i = 0; i < GPT_BLOCK_NSLOTS; i++) {
            bp.t[i] = w[i];
            bg.t[i] = gw[i];
            memset(gw[i], 0, t->desc[t->block_first[k] + i].numel * sizeof(float));
        }
        if ((r = fetch(t, t->act[k], ZINF_TIER_DEVICE, &a)) == 0) {
            r = gpt_block_backward(c, B, T, &bp, a, t->dx, t->dx, &bg, &t->scratch);
            zinf_release(t->e, t->act[k], ZINF_TIER_DEVICE, 0);
        }
        for (int i = 0; i < GPT_BLOCK_NSLOTS && r == 0; i++)
            r = add_sumsq(t, gw[i], t->desc[t->block_first[k] + i].numel);
        release_block(t, t->g, k, ZINF_TIER_DEVICE, r == 0 ? ZINF_RELEASE_DIRTY : 0);
        release_block(t, t->p, k, ZINF_TIER_DEVICE, 0);
        if (r < 0)
            goto out;
        note_peaks(t);
    }

    /* The embeddings: g_wte already holds the head's share. */
    float *gwte, *gwpe;
    TRY(fetch(t, t->g[t->wte], ZINF_TIER_DEVICE, &gwte));
    if ((r = fetch(t, t->g[t->wpe], ZINF_TIER_DEVICE, &gwpe)) == 0) {
        memset(gwpe, 0, t->desc[t->wpe].numel * sizeof(float));
        r = gpt_embed_backward(c, B, T, t->tokens, t->dx, gwte, gwpe);
        if (r == 0)
            r = add_sumsq(t, gwte, t->desc[t->wte].numel);
        if (r == 0)
            r = add_sumsq(t, gwpe, t->desc[t->wpe].numel);
        zinf_release(t->e, t->g[t->wpe], ZINF_TIER_DEVICE, r == 0 ? ZINF_RELEASE_DIRTY : 0);
    }
    zinf_release(t->e, t->g[t->wte], ZINF_TIER_DEVICE, r == 0 ? ZINF_RELEASE_DIRTY : 0);
out:
    return r;
}

/* AdamW over every tensor, in the host tier. The learned schedule prefetches the next
 * tensor's four parts while this one is updated. */
static int optimize(struct trainer *t, int step)
{
    struct adamw_hparams h;
    float scale = adamw_clip_scale(t->sumsq, t->o.grad_clip);
    int r = 0;

    adamw_hparams_defaults(&h);
    h.lr = t->o.lr;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        zinf_tensor hs[4] = {t->p[i], t->g[i], t->m[i], t->v[i]};
        float *p[4];
        int n;
        for (n = 0; n < 4; n++)
            if ((r = fetch(t, hs[n], ZINF_TIER_HOST, &p[n])) < 0)
                break;
        if (r == 0) {
            /* Decay the matrices only, as GPT-2 trainers do (not biases, norms). */
            h.weight_decay = t->desc[i].ndim == 2 ? t->o.weight_decay : 0.0f;
            r = adamw_update(p[0], p[1], p[2], p[3], t->desc[i].numel, &h, step, scale);
        }
        while (n-- > 0)
            zinf_release(t->e, hs[n], ZINF_TIER_HOST, n != 1 && r == 0 ? ZINF_RELEASE_DIRTY : 0);
        note_peaks(t);
    }
    return r;
}

int trainer_step(struct trainer *t, struct trainer_step_stats *st)
{
    struct zinf_stats s0, s1;
    int step = t->step_done + 1, r;
    float loss = 0;

    zinf_stats(t->e, &s0);
    uint64_t t0 = now_ns();
    load_batch(t, step);
    t->sumsq = 0;
    TRY(forward(t));
    TRY(head(t, &loss));
    TRY(backward(t));
    TRY(optimize(t, step));
    t->step_done = step;
    TRY(state_save(t));
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
    return r;
}

int trainer_checkpoint(struct trainer *t)
{
    int r = state_save(t);
    return r < 0 ? r : zinf_flush(t->e);
}

void trainer_get_summary(struct trainer *t, struct trainer_summary *out)
{
    struct zinf_stats st;
    *out = (struct trainer_summary){.steps_done = t->step_done};
    note_peaks(t);
    zinf_stats(t->e, &st);
    for (int i = 0; i < t->ntensors; i++)
        out->param_count += t->desc[i].numel;
    out->model_state_bytes = out->param_count * sizeof(float) * 4;
    for (int i = 0; i < 3; i++) {
        out->tier[i].budget_bytes = st.tier[i].capacity_bytes;
        out->tier[i].peak_bytes = t->peak[i];
    }
}
