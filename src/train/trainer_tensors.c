/*
 * trainer_tensors.c - the tensors a run registers in the engine and where they live: the
 * home of each (the offload devices and the persistence threshold decide), their sizes,
 * the ranks' scratch buffers, the first parameters of a new run, and the smallest device
 * and host budgets with which a step runs, checked before anything runs, and the budgets
 * derived where the config gives none (trainer_derive_budgets).
 *
 * Not here: the sets a step fetches (trainer_step.c, whose descriptions the budgets walk),
 * the shards' sizes (trainer_shards.c), the saved state (trainer_resume.c).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "train/adamw_states.h"
#include "train/backend.h"
#include "train/ops.h"
#include "train/trainer_impl.h"

/* Where each tensor lives (as register_all() registers them). What the device computes
 * with (w; p in fp32, where they are one) is homed with the parameters, or on the device
 * itself when it has fewer elements than stage3_param_persistence_threshold (DeepSpeed's
 * persistent parameters: small tensors are not worth a transfer each time). */
static enum zinf_tier role_home(const struct trainer *t, enum role role, int idx)
{
    enum zinf_tier ph = train_home_of(t->zc.zero.offload_param.device);
    enum zinf_tier oh = train_home_of(t->zc.zero.offload_optimizer.device);
    bool persist =
        role != R_ACT && t->persist_below && t->desc[idx].numel < (size_t)t->persist_below;
    switch (role) {
    case R_P:
        if (t->w != t->p) return oh; /* the fp32 master is optimizer state */
        return persist ? ZINF_TIER_DEVICE : ph;
    case R_W:
        return persist ? ZINF_TIER_DEVICE : ph;
    case R_ACT:
        return t->act_tier;
    case R_L:
    case R_GW:
        return ZINF_TIER_DEVICE; /* working memory of every step */
    default:
        return oh;
    }
}

/* Bytes of what is registered for role (tensor idx): a rank keeps a shard of the Adam
 * states from stage 1, of the gradients from stage 2, of the parameters (and of their
 * 16-bit copies, which are what is gathered) in stage 3. */
size_t train_role_bytes(const struct trainer *t, enum role role, int idx)
{
    if (role == R_ACT) /* sequence parallel: the rank's positions */
        return (size_t)t->o.batch * (t->o.seq / MAX(1, t->sp)) * t->cfg.C *
               backend_dtype_bytes(t->be->adt);
    size_t n = t->desc[idx].numel, sh = train_shard_of(t, idx);
    bool parted = t->world > 1 && !train_private(t, idx);
    switch (role) {
    case R_L:
        return (size_t)t->world * sh * sizeof(float);
    case R_GW:
        return (size_t)t->world * sh * backend_dtype_bytes(t->be->wdt);
    case R_M:
    case R_V: /* as zinf.optimizer_state_dtype stores them */
        return adamw_state_bytes((enum adamw_state_dtype)t->o.state_dtype,
                                 parted && t->stage >= 1 ? sh : n);
    case R_G:
        return (parted && t->stage >= 2 ? sh : n) * sizeof(float);
    case R_P:
        return (parted && train_stage_of(t, idx) >= 3 ? sh : n) * sizeof(float);
    default:
        return (parted && train_stage_of(t, idx) >= 3 ? sh : n) * backend_dtype_bytes(t->be->wdt);
    }
}

/* A representative tensor of each local slot (block 0's, or the tensor itself). */
static int slot_tensor(const struct trainer *t, int s)
{
    if (s < GPT_BLOCK_NSLOTS) return t->block_first[t->kb] + s;
    switch (s - GPT_BLOCK_NSLOTS) {
    case GPT_WTE:
        return t->wte;
    case GPT_WPE:
        return t->wpe;
    case GPT_LNF_W:
        return t->lnfw;
    default:
        return t->lnfb;
    }
}

/* What fetching w to tier allocates there: every member not homed there, rounded as the
 * tiers allocate. */
static uint64_t wave_need(const struct trainer *t, const struct wave *w, enum zinf_tier tier)
{
    return train_wave_need(t, w, tier, ~0u);
}

uint64_t train_wave_need(const struct trainer *t, const struct wave *w, enum zinf_tier tier,
                         unsigned roles)
{
    uint64_t need = 0;
    for (int i = 0; i < w->n; i++)
        if ((roles >> w->role[i] & 1) && role_home(t, (enum role)w->role[i], w->idx[i]) != tier)
            need += align_up(train_role_bytes(t, (enum role)w->role[i], w->idx[i]), ZINF_ALIGN);
    return need;
}

/* Bytes of every activation checkpoint the rank registers: its blocks' inputs and the last
 * one's output, in each slot of micro-batches in flight. */
static uint64_t act_all_bytes(const struct trainer *t)
{
    return (uint64_t)(t->ke - t->kb + 1) * (uint64_t)MAX(1, t->nslots) *
           align_up(train_role_bytes(t, R_ACT, 0), ZINF_ALIGN);
}

/* Whether this run has a swap directory of its own (a daemon's job has the daemon's). */
static bool own_nvme(const struct trainer *t)
{
    return t->zc.nvme_paths.count > 0 && !t->remote;
}

int train_act_mode(struct trainer *t, char *err, size_t errlen)
{
    static const char *const names[] = {"auto", "device", "host", "nvme"};
    bool given = config_given(&t->zc, "zinf.train.activation_offload");
    bool cpu_given = config_given(&t->zc, "activation_checkpointing.cpu_checkpointing");
    bool cpu = t->zc.activation_checkpointing.cpu_checkpointing;
    int mode = given ? t->zc.zinf.train.activation_offload : ACT_AUTO;
    if (!given && cpu_given) mode = cpu ? ACT_AUTO : ACT_DEVICE;
    if (given && cpu_given && cpu == (mode == ACT_DEVICE)) {
        snprintf(err, errlen,
                 "activation_checkpointing.cpu_checkpointing %s and "
                 "zinf.train.activation_offload \"%s\" disagree: give one",
                 cpu ? "true" : "false", names[mode]);
        return -EINVAL;
    }
    if (mode == ACT_NVME && !own_nvme(t) && !t->remote) {
        snprintf(err, errlen,
                 "zinf.train.activation_offload is \"nvme\" but no nvme_path is given "
                 "(zinf.nvme_paths or an offload section's nvme_path)");
        return -EINVAL;
    }
    t->act_mode = mode;
    t->act_tier = mode == ACT_DEVICE ? ZINF_TIER_DEVICE
                  : mode == ACT_NVME ? ZINF_TIER_NVME
                                     : ZINF_TIER_HOST;
    return 0;
}

void train_act_decide(struct trainer *t, const uint64_t cap[MEM_TIERS])
{
    uint64_t need[MEM_TIERS], homes[MEM_TIERS];
    const char *what[MEM_TIERS];
    if (t->act_mode != ACT_AUTO) return;
    t->act_tier = ZINF_TIER_HOST;
    if (!own_nvme(t) || !cap[ZINF_TIER_HOST]) return;
    train_min_budgets(t, need, homes, what);
    if (cap[ZINF_TIER_HOST] < need[ZINF_TIER_HOST]) t->act_tier = ZINF_TIER_NVME;
}

uint64_t train_act_host_bytes(const struct trainer *t)
{
    return t->act_mode == ACT_AUTO && t->act_tier == ZINF_TIER_HOST && !own_nvme(t) &&
                   !t->remote
               ? act_all_bytes(t)
               : 0;
}

/* train_min_budgets for the homes "auto" picks at the smallest budgets: with a swap
 * directory, the activation checkpoints on NVMe, where this run's tiers may have had room for
 * them in the host tier. Budgets at or above these run (train_act_decide moves the checkpoints
 * to NVMe where the host tier lacks room for them), and the refusal names these. */
void train_least_budgets(struct trainer *t, uint64_t need[MEM_TIERS], uint64_t homes[MEM_TIERS],
                         const char *what[MEM_TIERS])
{
    enum zinf_tier was = t->act_tier;
    if (t->act_mode == ACT_AUTO && was == ZINF_TIER_HOST && own_nvme(t))
        t->act_tier = ZINF_TIER_NVME;
    train_min_budgets(t, need, homes, what);
    t->act_tier = was;
}

/* The smallest capacity of each memory tier with which every step runs: the homes it
 * keeps for good plus the largest set a step fetches to it; *what[tier] names that set. */
void train_min_budgets(struct trainer *t, uint64_t need[MEM_TIERS], uint64_t homes[MEM_TIERS],
                       const char *what[MEM_TIERS])
{
    static const enum role kinds[] = {R_P, R_G, R_M, R_V, R_W};
    struct wave w;
    for (int k = 0; k < MEM_TIERS; k++) {
        need[k] = homes[k] = 0;
        what[k] = NULL;
    }
    for (int i = 0; i < t->ntensors; i++)
        for (size_t j = 0; j < sizeof(kinds) / sizeof(kinds[0]); j++) {
            if (kinds[j] == R_W && t->w == t->p) continue;
            if (train_frozen(t, i) && kinds[j] != R_P && kinds[j] != R_W) continue;
            enum zinf_tier h = role_home(t, kinds[j], i);
            if (h < MEM_TIERS) homes[h] += align_up(train_role_bytes(t, kinds[j], i), ZINF_ALIGN);
        }
    if (t->act_tier < MEM_TIERS)
        homes[t->act_tier] += act_all_bytes(t);
    for (int s = 0; s < NLOCAL; s++) {
        int i = slot_tensor(t, s);
        if (i < 0) continue;
        if (t->exact)
            homes[ZINF_TIER_DEVICE] += (s < GPT_BLOCK_NSLOTS && train_lg_set(t, 1) ? 2 : 1) *
                                       align_up(train_role_bytes(t, R_L, i), ZINF_ALIGN);
        if (train_stage_of(t, i) >= 3)
            homes[ZINF_TIER_DEVICE] += (s < GPT_BLOCK_NSLOTS && train_gw_set(t, 1) ? 2 : 1) *
                                       align_up(train_role_bytes(t, R_GW, i), ZINF_ALIGN);
    }
    enum zinf_tier sh = train_home_of(t->zc.zero.offload_param.device);
    if (sh < MEM_TIERS)
        homes[sh] +=
            align_up(sizeof(struct train_state), ZINF_ALIGN) +
            (t->be->wdt == BACKEND_F16 ? align_up(sizeof(struct loss_scale), ZINF_ALIGN) : 0) +
            (t->o.lora.r ? align_up(sizeof(struct lora_state), ZINF_ALIGN) : 0);

#define CONSIDER(tier)                                                                             \
    do {                                                                                           \
        uint64_t n_ = wave_need(t, &w, (tier));                                                    \
        if (n_ > need[(tier)]) {                                                                   \
            need[(tier)] = n_;                                                                     \
            what[(tier)] = w.what;                                                                 \
        }                                                                                          \
    } while (0)
    t->budgeting = true;
    bool first = t->wpe >= 0, last = t->lnfw >= 0; /* the pipeline stage's ends */
    if (first) {
        train_wave_embed_forward(t, &w);
        CONSIDER(ZINF_TIER_DEVICE);
    }
    for (int k = t->kb; k < t->ke; k++) {
        if (train_moe_block(t, k)) { /* its own sets: never its dense MLP's */
            for (int n = 0; train_moe_wave(t, k, n, &w); n++)
                CONSIDER(ZINF_TIER_DEVICE);
            continue;
        }
        train_wave_block_forward(t, k, &w);
        CONSIDER(ZINF_TIER_DEVICE);
        train_wave_block_backward(t, k, &w);
        CONSIDER(ZINF_TIER_DEVICE);
    }
    if (last) {
        train_wave_head(t, &w);
        CONSIDER(ZINF_TIER_DEVICE);
    }
    if (first) {
        train_wave_embed_backward(t, &w);
        CONSIDER(ZINF_TIER_DEVICE);
    }
    for (int i = 0; i < t->ntensors; i++) {
        if (train_frozen(t, i)) continue; /* never updated */
        train_wave_optimizer(t, i, &w);
        CONSIDER(t->opt_tier);
    }
    if (t->o.sample) {
        train_wave_sample(t, &w);
        CONSIDER(ZINF_TIER_HOST);
    }
#undef CONSIDER
    t->budgeting = false;
    for (int k = 0; k < MEM_TIERS; k++)
        need[k] += homes[k];
}

/* The refusal of budgets under what a step needs (cap[k] < need[k]; cap[k] 0: not known,
 * taken as enough), naming the smallest ones that would run (zinf.device_bytes and
 * zinf.host_bytes take them as they are): -EINVAL with it in err, or 0. trainer_open and
 * trainer_plan_check say it in the same words. */
int train_budget_refusal(const uint64_t cap[MEM_TIERS], const uint64_t need[MEM_TIERS],
                         const uint64_t homes[MEM_TIERS], const char *const what[MEM_TIERS],
                         uint64_t act_host, char *err, size_t errlen)
{
    static const char *const key[MEM_TIERS] = {"zinf.device_bytes", "zinf.host_bytes"};
    static const char *const where[MEM_TIERS] = {"the device", "the host tier"};
    size_t len = 0;

    err[0] = '\0';
    for (int k = 0; k < MEM_TIERS; k++) {
        char a[32], b[32], c[32], d[32];
        if (!cap[k] || cap[k] >= need[k] || len >= errlen) continue;
        char pins[160] = "", homed[96] = "";
        if (what[k])
            snprintf(pins, sizeof(pins), "%s pins %s on %s at once", what[k],
                     format_size(need[k] - homes[k], c, sizeof(c)), where[k]);
        if (homes[k])
            snprintf(homed, sizeof(homed), "%s%s of tensors are homed there", what[k] ? ", " : "",
                     format_size(homes[k], d, sizeof(d)));
        len += (size_t)snprintf(
            err + len, errlen - len, "%s%s: %s is too small: %s%s; %s (%llu bytes) runs",
            len ? "; " : "", key[k], format_size(cap[k], a, sizeof(a)), pins, homed,
            format_size(need[k], b, sizeof(b)), (unsigned long long)need[k]);
    }
    if (!len) return 0;
    if (len < errlen)
        snprintf(err + len, errlen - len,
                 ". The smallest budgets that run this model and batch: \"zinf\": "
                 "{\"device_bytes\": %llu, \"host_bytes\": %llu} (or shrink --dim, --batch or "
                 "--seq)",
                 (unsigned long long)need[ZINF_TIER_DEVICE],
                 (unsigned long long)need[ZINF_TIER_HOST]);
    len = strlen(err);
    /* The activation checkpoints, when they are what the host tier lacks room for, go to
     * NVMe given a swap directory. */
    if (act_host && cap[ZINF_TIER_HOST] && cap[ZINF_TIER_HOST] < need[ZINF_TIER_HOST] &&
        len < errlen) {
        char a[32];
        snprintf(err + len, errlen - len,
                 "; the activation checkpoints take %s of the host tier: with an NVMe swap "
                 "directory (zinf.nvme_paths), zinf.train.activation_offload \"auto\" homes "
                 "them there when the host budget cannot hold them",
                 format_size(act_host, a, sizeof(a)));
    }
    return -EINVAL;
}

/* Refuse, before anything runs, budgets with which a step could not run: the engine's
 * tiers as they opened, against what the steps need. */
int train_check_budgets(struct trainer *t, char *err, size_t errlen)
{
    uint64_t need[MEM_TIERS], homes[MEM_TIERS], cap[MEM_TIERS];
    const char *what[MEM_TIERS];
    struct zinf_stats st;

    zinf_stats(t->e, &st);
    for (int k = 0; k < MEM_TIERS; k++)
        cap[k] = st.tier[k].capacity_bytes;
    train_act_decide(t, cap);
    train_least_budgets(t, need, homes, what);
    t->min_budget[ZINF_TIER_DEVICE] = need[ZINF_TIER_DEVICE];
    t->min_budget[ZINF_TIER_HOST] = need[ZINF_TIER_HOST];
    return train_budget_refusal(cap, need, homes, what, train_act_host_bytes(t), err, errlen);
}

static int reg(struct trainer *t, const char *prefix, const char *name, size_t bytes,
               enum zinf_tier home, zinf_tensor *out)
{
    char full[96];
    snprintf(full, sizeof(full), "%s%s", prefix, name);
    if (t->o.resume) return zinf_lookup(t->e, full, out);
    zinf_tensor old;
    int r;
    /* Through the daemon, --overwrite starts the job over one tensor at a time. */
    if (t->remote && t->o.overwrite && zinf_lookup(t->e, full, &old) == 0 &&
        (r = zinf_unregister(t->e, old)) < 0)
        return r;
    return zinf_register(t->e, full, bytes, home, out);
}

/* A resumed tensor's home is the saved run's: it must be where this run's budget check
 * put it (the offload devices and the persistence threshold decide). */
static int check_home(struct trainer *t, zinf_tensor h, enum zinf_tier want, const char *name,
                      char *err, size_t errlen)
{
    static const char *const tiers[] = {"the device", "the host", "NVMe"};
    if (t->remote) return 0; /* the daemon's engine is not ours to look into: its job is trusted */
    struct zinf_tensor_info ti;
    enum zinf_tier got = zinf_tensor_info(t->e, h, &ti) == 0 ? ti.home : want;
    if (got == want) return 0;
    snprintf(err, errlen,
             "--resume: the saved run keeps '%s' on %s, this config on %s: give "
             "the saved run's offload devices and stage3_param_persistence_threshold",
             name, tiers[got], tiers[want]);
    return -EINVAL;
}

/* A resumed Adam state's size is that of the dtype it was saved in: another
 * zinf.optimizer_state_dtype would read its bytes as another type. (Its shard's size
 * follows the partition, which the zero state checks.) */
static int check_state_bytes(struct trainer *t, zinf_tensor h, size_t want, const char *name,
                             char *err, size_t errlen)
{
    struct zinf_tensor_info ti;
    if (t->remote || zinf_tensor_info(t->e, h, &ti) < 0 || ti.bytes == want) return 0;
    snprintf(err, errlen,
             "--resume: the saved run keeps '%s' in %llu bytes, and zinf.optimizer_state_dtype "
             "\"%s\" needs %zu: give the saved run's zinf.optimizer_state_dtype (its states "
             "are not converted)",
             name, (unsigned long long)ti.bytes,
             adamw_state_dtype_name((enum adamw_state_dtype)t->o.state_dtype), want);
    return -EINVAL;
}

#define SCRATCH_KINDS 4

/* Local slot s's buffer of kind k (0: local gradients when exact, 1: gathered weights in
 * stage 3, 2: the odd blocks' gathered weights, 3: the odd blocks' local gradients with
 * overlap_comm): its name, and its handle and size; NULL when this run has none (name is
 * written all the same). */
static zinf_tensor *scratch(struct trainer *t, int s, int k, char name[64], size_t *bytes)
{
    static const char *const kind[SCRATCH_KINDS] = {"zero.grad.", "zero.gather.", "zero.gather1.",
                                                    "zero.grad1."};
    int i = slot_tensor(t, s);
    if (i < 0) return NULL; /* a pipeline stage without this tensor */
    snprintf(name, 64, "%s%s", kind[k],
             s < GPT_BLOCK_NSLOTS ? gpt_block_slot_name(s) : t->desc[i].name);
    bool block = s < GPT_BLOCK_NSLOTS;
    bool has = k == 0   ? t->exact
               : k == 3 ? block && train_lg_set(t, 1)
                        : train_stage_of(t, i) >= 3 && (k == 1 || (block && train_gw_set(t, 1)));
    if (!has) return NULL;
    *bytes = train_role_bytes(t, k == 0 || k == 3 ? R_L : R_GW, i);
    return k == 0 ? &t->lg[s] : k == 1 ? &t->gw[s] : k == 2 ? &t->gw1[s] : &t->lg1[s];
}

/* The device tier's bytes of scratch buffers: fixed, whatever the number of ranks. */
uint64_t train_scratch_bytes(struct trainer *t)
{
    uint64_t sum = 0;
    for (int s = 0; s < NLOCAL; s++)
        for (int k = 0; k < SCRATCH_KINDS; k++) {
            char name[64];
            size_t bytes;
            if (scratch(t, s, k, name, &bytes)) sum += align_up(bytes, ZINF_ALIGN);
        }
    return sum;
}

/* Before a checkpoint, the scratch buffers are registered afresh (reading as zeros), and the
 * activation checkpoints homed on NVMe are zeroed (no byte moves), so that the swap files
 * never hold what a step rebuilds. */
int train_scratch_reset(struct trainer *t)
{
    int r = 0;
    t->gw_holds[0] = t->gw_holds[1] = -1;
    for (int j = 0; j < MAX(1, t->nslots) * (t->cfg.L + 1) && r == 0; j++)
        if (t->act_tier == ZINF_TIER_NVME && t->act[j]) r = zinf_zero(t->e, t->act[j]);
    for (int s = 0; s < NLOCAL && r == 0; s++)
        for (int k = 0; k < SCRATCH_KINDS && r == 0; k++) {
            char name[64];
            size_t bytes;
            zinf_tensor *h = scratch(t, s, k, name, &bytes);
            if (h && (r = zinf_unregister(t->e, *h)) == 0)
                r = zinf_register(t->e, name, bytes, ZINF_TIER_DEVICE, h);
        }
    return r;
}

int train_register_all(struct trainer *t, char *err, size_t errlen)
{
    size_t act = (size_t)t->o.batch * t->o.seq * t->cfg.C * backend_dtype_bytes(t->be->adt);
    bool mixed = t->w != t->p;
    char name[32];
    int r = 0;

    /* In fp32 the parameters the device computes with are the master weights, homed with
     * the parameters; in bf16 the bf16 copies are, and the fp32 masters are optimizer state. */
    static const enum role kinds[] = {R_P, R_G, R_M, R_V, R_W};
    static const char *const prefix[] = {"p.", "g.", "m.", "v.", "w."};
    /* A resume trains the saved run's adapters, or none where it trained none. */
    if ((r = train_lora_state(t, err, errlen)) < 0) return r;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        const char *n = t->desc[i].name;
        zinf_tensor *out[] = {&t->p[i], &t->g[i], &t->m[i], &t->v[i], &t->w[i]};
        size_t bytes = 0;
        for (int k = 0; k < (mixed ? 5 : 4) && r == 0; k++) {
            /* A frozen weight (LoRA) has neither gradient nor optimizer state. */
            if (train_frozen(t, i) && kinds[k] != R_P && kinds[k] != R_W) continue;
            enum zinf_tier home = role_home(t, kinds[k], i);
            bytes = train_role_bytes(t, kinds[k], i);
            /* A base of another job's (zinf.base_job) is looked up there, never made. */
            if (train_engine_of(t, kinds[k], i) != t->e) {
                if ((r = train_base_lookup(t, prefix[k], i, bytes, out[k], err, errlen)) < 0)
                    return r;
                continue;
            }
            r = reg(t, prefix[k], n, bytes, home, out[k]);
            if (r == 0 && t->o.resume) {
                char full[96];
                snprintf(full, sizeof(full), "%s%s", prefix[k], n);
                if ((r = check_home(t, *out[k], home, full, err, errlen)) < 0 ||
                    ((kinds[k] == R_M || kinds[k] == R_V) &&
                     (r = check_state_bytes(t, *out[k], bytes, full, err, errlen)) < 0))
                    return r;
            }
        }
        if (r < 0 && t->o.resume)
            snprintf(err, errlen,
                     "--resume: tensor '%s' is not in the swap directory: is it the "
                     "saved run's, with the same model?",
                     n);
        else if (r < 0)
            snprintf(err, errlen, "tensor '%s' (%zu bytes): %s", n, bytes, zinf_strerror(r));
    }
    /* A pipeline stage's micro-batches in flight keep theirs in slots of their own. */
    for (int j = 0; j < t->nslots * (t->cfg.L + 1) && r == 0; j++) {
        int k = j % (t->cfg.L + 1), slot = j / (t->cfg.L + 1);
        if (k < t->kb || k > t->ke) continue;
        if (slot)
            snprintf(name, sizeof(name), "%d.%d", slot, k);
        else
            snprintf(name, sizeof(name), "%d", k);
        /* Activations are rebuilt every step; a resumed run finds the last ones (the flush
         * keeps every tensor) and overwrites them, or registers them afresh where this run
         * homes them elsewhere (other budgets, or zinf.train.activation_offload). */
        char full[48];
        struct zinf_tensor_info ti;
        snprintf(full, sizeof(full), "act.%s", name);
        r = t->o.resume ? zinf_lookup(t->e, full, &t->act[j]) : -ENOENT;
        if (r == 0 && !t->remote && zinf_tensor_info(t->e, t->act[j], &ti) == 0 &&
            ti.home != t->act_tier && (r = zinf_unregister(t->e, t->act[j])) == 0)
            r = -ENOENT;
        if (r == -ENOENT)
            r = t->o.resume ? zinf_register(t->e, full, act, t->act_tier, &t->act[j])
                            : reg(t, "act.", name, act, t->act_tier, &t->act[j]);
        if (r < 0)
            snprintf(err, errlen, "activation checkpoint %d (%zu bytes) %s: %s", k, act,
                     t->act_tier == ZINF_TIER_DEVICE ? "on the device tier"
                     : t->act_tier == ZINF_TIER_HOST ? "in the host tier"
                                                     : "on NVMe",
                     zinf_strerror(r));
    }
    /* The local gradients and gathered weights: working memory on the device tier, found
     * again on a resume like the activations. */
    for (int s = 0; s < NLOCAL && r == 0; s++) {
        for (int k = 0; k < SCRATCH_KINDS && r == 0; k++) {
            char full[64];
            size_t bytes;
            zinf_tensor *out = scratch(t, s, k, full, &bytes), old;
            if (!out) {
                /* A saved run's buffer this run does not use (other settings) would hold
                 * device memory the budget check did not count. */
                if (t->o.resume && zinf_lookup(t->e, full, &old) == 0)
                    r = zinf_unregister(t->e, old);
                continue;
            }
            r = t->o.resume ? zinf_lookup(t->e, full, out) : -ENOENT;
            if (r == -ENOENT)
                r = t->o.resume ? zinf_register(t->e, full, bytes, ZINF_TIER_DEVICE, out)
                                : reg(t, "", full, bytes, ZINF_TIER_DEVICE, out);
            if (r < 0)
                snprintf(err, errlen, "%s (%zu bytes) on the device tier: %s", full, bytes,
                         zinf_strerror(r));
        }
    }
    if (r == 0) {
        r = reg(t, "", STATE_NAME, sizeof(struct train_state),
                train_home_of(t->zc.zero.offload_param.device), &t->state);
        if (r < 0)
            snprintf(err, errlen, "%s: %s", STATE_NAME,
                     t->o.resume ? "no training state to resume in the swap directory"
                                 : zinf_strerror(r));
    }
    if (r == 0 && t->world > 1) {
        /* The partition the saved run was cut by: another would read shards as others. */
        struct zero_state z = {.magic = ZERO_MAGIC,
                               .world = t->world,
                               .stage = t->stage,
                               .rank = t->rank,
                               .persist = (int32_t)MIN(t->persist_below, (uint64_t)INT32_MAX)},
                          saved;
        r = reg(t, "", ZERO_NAME, sizeof(z), train_home_of(t->zc.zero.offload_param.device),
                &t->zstate);
        if (r == 0 && t->o.resume &&
            (r = zinf_read(t->e, t->zstate, 0, &saved, sizeof(saved))) == 0 &&
            (saved.magic != ZERO_MAGIC || saved.world != z.world || saved.stage != z.stage ||
             saved.rank != z.rank)) {
            /* (Another persistence threshold moves the small weights' homes: check_home()
             * has refused it by now.) */
            snprintf(err, errlen,
                     "--resume: the saved run was cut for %d ranks at ZeRO stage %d (this is rank "
                     "%d of it); this run is %d ranks at stage %d: give the saved run's",
                     saved.world, saved.stage, saved.rank, z.world, z.stage);
            return -EINVAL;
        }
        if (r == 0 && !t->o.resume) r = zinf_write(t->e, t->zstate, 0, &z, sizeof(z));
        if (r < 0) snprintf(err, errlen, "%s: %s", ZERO_NAME, zinf_strerror(r));
    }
    if (r == 0 && t->be->wdt == BACKEND_F16) {
        /* The loss scaler goes on where the saved run left it. */
        r = reg(t, "", SCALER_NAME, sizeof(struct loss_scale),
                train_home_of(t->zc.zero.offload_param.device), &t->scaler);
        if (r == 0 && t->o.resume) r = zinf_read(t->e, t->scaler, 0, &t->ls, sizeof(t->ls));
        if (r < 0) snprintf(err, errlen, "%s: %s", SCALER_NAME, zinf_strerror(r));
    }
    return r;
}

/* Tensor i's 16-bit weights (the rank's part: n elements) = p cast to bf16 or fp16, through
 * b16 (n elements). */
int train_write_w(struct trainer *t, int i, const float *p, uint16_t *b16, size_t n)
{
    if (t->be->wdt == BACKEND_F16)
        ops_cast_f32_to_f16(b16, p, n);
    else
        ops_cast_f32_to_bf16(b16, p, n);
    return zinf_write(t->e, t->w[i], 0, b16, n * sizeof(uint16_t));
}

/* Every weight of a new run from get, in the layout's order: the fp32 master (at ZeRO stage
 * 3, this rank's shard of the whole tensor, zeros past its end) and the 16-bit copy the
 * device computes with where the run has one, cast from it. */
int train_write_params(struct trainer *t, trainer_param_source get, void *ctx)
{
    float *buf = NULL;
    uint16_t *b16 = NULL;
    size_t cap = 0;
    int r = 0;
    for (int i = 0; i < t->ntensors && r == 0; i++) {
        if (train_engine_of(t, R_P, i) != t->e) continue; /* the base job's, as it is */
        size_t n = t->desc[i].numel;
        bool shard = train_stage_of(t, i) >= 3;
        size_t lo = shard ? train_shard_lo(t, i) : 0, sh = shard ? train_shard_of(t, i) : n;
        size_t room = MAX(n, lo + sh); /* the whole tensor, and the shard's padding */
        if (room > cap) {
            free(buf);
            free(b16);
            buf = malloc(room * sizeof(float));
            b16 = malloc(room * sizeof(uint16_t));
            cap = room;
            if (!buf || !b16) {
                r = -ENOMEM;
                break;
            }
        }
        /* An adapter starts as PEFT's; the model's tensors come by the whole model's order,
         * whole: a tensor-parallel rank keeps its slice. */
        if (train_lora_adapter(t, i)) {
            r = train_lora_init(t, i, buf);
        } else if (train_tp_sliced(t, i)) {
            const struct gpt_tensor_desc *gd = &t->gdesc[t->gidx[i]];
            float *whole = malloc(gd->numel * sizeof(float));
            r = whole ? get(ctx, t->gidx[i], whole) : -ENOMEM;
            if (r == 0) r = gpt_tp_slice_out(&t->cfg, t->tp, t->tr, gd, whole, buf);
            free(whole);
            if (r < 0) break;
        } else if ((r = get(ctx, t->gidx ? t->gidx[i] : i, buf)) < 0)
            break;
        if (shard) {
            size_t own = train_shard_own(t, i);
            memmove(buf, buf + lo, own * sizeof(float));
            memset(buf + own, 0, (sh - own) * sizeof(float));
        }
        r = zinf_write(t->e, t->p[i], 0, buf, sh * sizeof(float));
        if (r == 0 && t->w != t->p) r = train_write_w(t, i, buf, b16, sh);
    }
    free(buf);
    free(b16);
    return r;
}

/* GPT-2's initialisation of tensor i of the whole model's layout (gpt_init_tensor, from the
 * run's seed), which a pipeline stage holds under another number. */
static int init_source(void *ctx, int i, float *dst)
{
    struct trainer *t = ctx;
    if (t->gdesc) return gpt_init_tensor(&t->cfg, &t->gdesc[i], dst, t->o.seed);
    return gpt_init_tensor(&t->cfg, &t->desc[i], dst, t->o.seed);
}

int train_init_params(struct trainer *t)
{
    if (t->o.init_source) return train_write_params(t, t->o.init_source, t->o.init_ctx);
    return train_write_params(t, init_source, t);
}

/* RAM available now: /proc/meminfo's MemAvailable, else the free pages. */
static uint64_t ram_available(void)
{
    FILE *f = fopen("/proc/meminfo", "re");
    char line[256];
    unsigned long long kib = 0;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
    if (f) fclose(f);
    if (kib) return (uint64_t)kib * 1024;
    long pages = sysconf(_SC_AVPHYS_PAGES), size = sysconf(_SC_PAGESIZE);
    return pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size : 0;
}

void trainer_derive_budgets(const struct trainer_opts *o, const struct zinf_config *zc, bool cuda,
                            struct trainer_budgets *b)
{
    *b = (struct trainer_budgets){0};
    struct gpt_config cfg = o->model;
    cfg.maxT = o->seq;
    int n = gpt_layout(&cfg, NULL, 0);
    struct gpt_tensor_desc *d = n > 0 ? calloc((size_t)n, sizeof(*d)) : NULL;
    if (!d || gpt_layout(&cfg, d, (size_t)n) != n) {
        free(d);
        return;
    }
    /* Every tensor the trainer registers (trainer_tensors.c), bounded from above: parameters,
     * gradients, Adam's m and v and the 16-bit copies; the activation checkpoints; the
     * scratch buffers, up to four per tensor of one block and of the top, each padded to
     * whole shards of every rank; and each tensor's alignment. */
    uint64_t world = (uint64_t)MAX(1, o->world), slot_floats = 0;
    bool mixed = o->precision != TRAINER_PRECISION_FP32;
    for (int i = 0; i < n; i++)
        if (d[i].block <= 0) slot_floats += d[i].numel;
    uint64_t state =
        (uint64_t)gpt_num_params(&cfg) * (16 + (mixed ? 2 : 0)) +
        (uint64_t)(cfg.L + 1) * o->batch * o->seq * cfg.C * sizeof(float) +
        4 * (slot_floats * sizeof(float) + NLOCAL * world * SHARD_FLOATS * sizeof(float)) +
        ((uint64_t)n * 6 + (uint64_t)cfg.L + 1 + 4 * NLOCAL + 1) * ZINF_ALIGN;
    free(d);
    uint64_t most = state + state / 4 + 16 * MiB, avail = ram_available();
    char a[32], m[32], v[32], w[64] = "";
    b->state_bytes = state;
    format_size(most, m, sizeof(m));
    format_size(avail, a, sizeof(a));
    if (world > 1) snprintf(w, sizeof(w), ", over %llu ranks", (unsigned long long)world);
    uint64_t dev = 0;
    if (!config_given(zc, "zinf.device_bytes")) {
        if (cuda) {
            snprintf(b->device_how, sizeof(b->device_how),
                     "the engine's: the GPU's free memory at open less 1 GiB");
        } else {
            dev = MIN(avail / 4 / world, most);
            b->device = dev = align_up(MAX(dev, 1), ZINF_ALIGN);
            snprintf(b->device_how, sizeof(b->device_how),
                     "a quarter of the %s of RAM available%s, at most the run's state and a "
                     "quarter more plus 16 MiB (%s)",
                     a, w, m);
        }
    }
    if (!config_given(zc, "zinf.host_bytes")) {
        uint64_t left = avail > dev * world ? avail - dev * world : 0;
        b->host = align_up(MAX(MIN(left / 2 / world, most), 1), ZINF_ALIGN);
        format_size(left, v, sizeof(v));
        snprintf(b->host_how, sizeof(b->host_how),
                 "half of the %s of RAM left beside the device's%s, at most the run's state and "
                 "a quarter more plus 16 MiB (%s)",
                 v, w, m);
    }
}
