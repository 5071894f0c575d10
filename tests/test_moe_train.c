/*
 * test_moe_train.c - mixture of experts in zinf train, through the binary as a user runs it:
 * the settings from the command line and the config's moe section, and the refusals that
 * name the key or option a run cannot have with MoE blocks.
 *
 * The runs: the losses of a model with MoE blocks are the bits of a reference computed here
 * from gpt.c, moe.c and adamw.c over tensors in memory, whether the run's parameters live in
 * memory or on NVMe, and from run to run, and go down; the NVMe bytes its steps
 * read for experts follow the experts a step routes tokens to, not all of them.
 *
 * Not here: the MoE math (test_moe.c), the block halves it rests on (test_train_ops.c), the
 * config reader's own checks of the section (test_config.c).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "helpers.h"
#include "train/adamw.h"
#include "train/gpt.h"
#include "train/moe.h"
#include "train/ops.h"

static char *dir;
static int micro = 2; /* train_micro_batch_size_per_gpu in config() */

static void setup(void)
{
    dir = test_tmpdir("moe-train");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
}

TestSuite(moe_train, .init = setup, .fini = teardown, .timeout = 60);

#define run test_run_zinf
#define DATA "/usr/share/common-licenses/GPL-3"

/* A config with `extra` inside the top object: a small model on the emulated device. */
static void config(char *path, size_t len, const char *extra)
{
    snprintf(path, len, "%s/moe.json", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{%s \"train_micro_batch_size_per_gpu\": %d, \"zinf\": {\"device\": \"emulated\", "
            "\"train\": {\"layers\": 2, \"dim\": 32, \"heads\": 2, \"seq\": 8}}}",
            extra, micro);
    fclose(f);
}

/* Each case fails (exit status not 0) with `want` in what it printed. */
Test(moe_train, what_a_run_cannot_have_is_refused_naming_it)
{
    char cfg[4096], *o;
    static const struct {
        int n;
        const char *extra, *args, *want;
    } cases[] = {
        {1, "", "--experts 4 --top-k 3", "--top-k: "},
        {1, "", "--experts 4097", "--experts: "},
        {1, "", "--experts 1 --top-k 2", "moe.top_k (--top-k) 2: more than the 1 expert"},
        {1, "\"moe\": {\"num_experts\": 4, \"moe_every\": 3},", "",
         "moe.moe_every 3: expected 1 to the 2 blocks"},
        {1, "\"moe\": {\"num_experts\": 4, \"ep_size\": 2},", "",
         "moe.ep_size 2: the expert-parallel group is the data-parallel ranks, 1 here"},
        {1, "\"moe\": {\"num_experts\": 4, \"use_rts\": true},", "", "moe.use_rts: true is not built"},
        {2, "\"moe\": {\"num_experts\": 4},", "",
         "zinf launch: -n 2 does not fit"},
        {2, "\"moe\": {\"num_experts\": 3, \"ep_size\": 2},", "",
         "ep_size must divide num_experts"},
        {4, "\"moe\": {\"num_experts\": 4, \"ep_size\": 4}, \"pipeline\": {\"stages\": 2},",
         "", "moe.ep_size 4 splits the 4 experts across the copies of each stage, 2 here"},
        {1, "", "--experts 4 --eval-every 1",
         "--eval-every with --experts 4 (moe.num_experts): the forward"},
        {2, "\"moe\": {\"num_experts\": 4, \"ep_size\": 2},", "--export never.safetensors",
         "--export with --experts 4 (moe.num_experts): each of the ranks holds its own"},
    };
    for (size_t c = 0; c < ARRAY_SIZE(cases); c++) {
        config(cfg, sizeof(cfg), cases[c].extra);
        int r = cases[c].n == 1
                    ? run(&o, "train --config %s --data " DATA " --steps 1 %s", cfg, cases[c].args)
                    : run(&o, "launch -n %d -- %s train --config %s --data " DATA " --steps 1 %s",
                          cases[c].n, getenv("ZINF_BIN"), cfg, cases[c].args);
        cr_expect_neq(r, 0, "case %zu: %s", c, o);
        cr_expect(strstr(o, cases[c].want), "case %zu: no '%s' in: %s", c, cases[c].want, o);
        free(o);
    }
    /* --experts 0 (and no moe section) is the dense GPT: it runs. */
    config(cfg, sizeof(cfg), "");
    int r = run(&o, "train --config %s --data " DATA " --steps 1 --experts 0", cfg);
    cr_expect_eq(r, 0, "%s", o);
    free(o);
}

/* One step's line of a --log file. */
struct step_line {
    char loss[40];
    char digest[40]; /* of the parameters after the step */
    char norm[40];   /* the gradient norm */
    double aux;
    int used, experts;
    unsigned long long read, fetches, hits;
};

/* The step lines of the log at path into out (at most max); their count. */
static int read_log(const char *path, struct step_line *out, int max)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    char line[8192];
    int n = 0;
    while (fgets(line, sizeof(line), f) && n < max) {
        if (strncmp(line, "{\"step\":", 8)) continue;
        struct step_line *s = &out[n++];
        const char *l = strstr(line, "\"loss\":"), *a = strstr(line, "\"moe_aux_loss\":"),
                   *u = strstr(line, "\"experts_used\":"), *e = strstr(line, "\"experts\":"),
                   *r = strstr(line, "\"expert_bytes_read\":"), *g = strstr(line, "\"digest\":");
        cr_assert(l && a && u && e && r && g, "a step line without the MoE fields: %s", line);
        cr_assert_eq(sscanf(l + 7, "%39[^,]", s->loss), 1);
        cr_assert_eq(sscanf(g + 9, "%39[^,}]", s->digest), 1);
        const char *gn = strstr(line, "\"grad_norm\":");
        cr_assert(gn, "a step line without grad_norm: %s", line);
        cr_assert_eq(sscanf(gn + 12, "%39[^,}]", s->norm), 1);
        s->aux = strtod(a + 15, NULL);
        s->used = atoi(u + 15);
        s->experts = atoi(e + 10);
        s->read = strtoull(r + 20, NULL, 10);
        const char *fe = strstr(line, "\"expert_fetches\":"),
                   *h = strstr(line, "\"expert_hits\":");
        cr_assert(fe && h, "a step line without the experts' fetches and hits: %s", line);
        s->fetches = strtoull(fe + 17, NULL, 10);
        s->hits = strtoull(h + 14, NULL, 10);
    }
    fclose(f);
    return n;
}

/* A run up to step `steps` with the MoE settings in args (--resume among them goes on from
 * a saved one), the parameters on NVMe (under swap) or in memory (swap NULL), logged to
 * name.jsonl in the test's folder. */
static void train_to(const char *name, const char *swap, const char *args, int steps)
{
    char cfg[4096], log[4096], *o;
    char extra[2048] = "";
    if (swap)
        snprintf(extra, sizeof(extra),
                 "\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", "
                 "\"nvme_path\": \"%s\"}},",
                 swap);
    config(cfg, sizeof(cfg), extra);
    snprintf(log, sizeof(log), "%s/%s.jsonl", dir, name);
    int r = run(&o, "train --config %s --data " DATA " --steps %d --log %s %s", cfg, steps,
                log, args);
    cr_assert_eq(r, 0, "%s: %s", name, o);
    free(o);
}

/* The same, and its step lines into out (at most `steps`); their count. */
static int train_run(const char *name, const char *swap, const char *args, int steps,
                     struct step_line *out)
{
    char log[4096];
    train_to(name, swap, args, steps);
    snprintf(log, sizeof(log), "%s/%s.jsonl", dir, name);
    return read_log(log, out, steps);
}

/* ---- the reference: the model in memory, step by step as the trainer runs it ---------- */

#define RL 2
#define RC 32
#define RE 4
#define RB 2
#define RT 8
#define RSEED 1337
#define RLR 3e-3f
#define RCOEF 0.01f

struct rt {
    struct gpt_tensor_desc d;
    float *p, *g, *m, *v;
    bool used; /* has a gradient this step */
};

/* The trainer's layout: the dense one (a MoE block's MLP left out: never used), then each
 * block's gate and experts. */
struct ref {
    struct gpt_config cfg;
    struct rt wte, wpe, lnfw, lnfb;
    struct rt blk[RL][8], gate[RL], ex[RL][RE][4];
};

static void rt_init(const struct gpt_config *cfg, struct rt *x, const struct gpt_tensor_desc *d)
{
    x->d = *d;
    x->p = calloc(d->numel, sizeof(float));
    x->g = calloc(d->numel, sizeof(float));
    x->m = calloc(d->numel, sizeof(float));
    x->v = calloc(d->numel, sizeof(float));
    cr_assert(x->p && x->g && x->m && x->v);
    cr_assert_eq(gpt_init_tensor(cfg, d, x->p, RSEED), 0);
}

static void rt_free(struct rt *x)
{
    free(x->p);
    free(x->g);
    free(x->m);
    free(x->v);
}

static void ref_init(struct ref *R)
{
    R->cfg = (struct gpt_config){.V = 256, .maxT = RT, .L = RL, .C = RC, .NH = 2};
    int n = gpt_layout(&R->cfg, NULL, 0);
    struct gpt_tensor_desc *d = calloc((size_t)n, sizeof(*d));
    cr_assert_not_null(d);
    gpt_layout(&R->cfg, d, (size_t)n);
    rt_init(&R->cfg, &R->wte, &d[0]);
    rt_init(&R->cfg, &R->wpe, &d[1]);
    rt_init(&R->cfg, &R->lnfw, &d[n - 2]);
    rt_init(&R->cfg, &R->lnfb, &d[n - 1]);
    for (int k = 0; k < RL; k++) {
        const struct gpt_tensor_desc *b = &d[2 + k * GPT_BLOCK_NSLOTS];
        for (int s = 0; s < 8; s++)
            rt_init(&R->cfg, &R->blk[k][s], &b[s]);
        struct gpt_tensor_desc g = {.block = k, .slot = GPT_BLOCK_NSLOTS, .ndim = 2,
                                    .shape = {RE, RC}, .numel = RE * RC};
        snprintf(g.name, sizeof(g.name), "h%d.moe.gate.w", k);
        rt_init(&R->cfg, &R->gate[k], &g);
        for (int e = 0; e < RE; e++)
            for (int s = 0; s < 4; s++) {
                struct gpt_tensor_desc x = b[GPT_FC_W + s];
                snprintf(x.name, sizeof(x.name), "h%d.expert%d.%s", k, e,
                         gpt_block_slot_name(GPT_FC_W + s) + 4);
                rt_init(&R->cfg, &R->ex[k][e][s], &x);
            }
    }
    free(d);
}

/* Every tensor of the reference, for the loops that visit them all. */
static int ref_all(struct ref *R, struct rt **out)
{
    int n = 0;
    out[n++] = &R->wte;
    out[n++] = &R->wpe;
    out[n++] = &R->lnfw;
    out[n++] = &R->lnfb;
    for (int k = 0; k < RL; k++) {
        for (int s = 0; s < 8; s++)
            out[n++] = &R->blk[k][s];
        out[n++] = &R->gate[k];
        for (int e = 0; e < RE; e++)
            for (int s = 0; s < 4; s++)
                out[n++] = &R->ex[k][e][s];
    }
    return n;
}

#define REF_N (4 + RL * (9 + 4 * RE))

static uint64_t mix64(uint64_t z) /* the trainer's batch generator (trainer.c) */
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void sumsq(double *acc, const struct rt *x)
{
    double s;
    cr_assert_eq(adamw_sum_squares(x->g, x->d.numel, &s), 0);
    *acc += s;
}

/* The reported losses of `steps` steps. */
static void ref_losses(float *loss, int steps)
{
    struct ref R;
    struct rt *all[REF_N];
    ref_init(&R);
    int nall = ref_all(&R, all);
    cr_assert_eq(nall, REF_N);
    FILE *f = fopen(DATA, "rb");
    cr_assert_not_null(f);
    static unsigned char data[1 << 16];
    size_t bytes = fread(data, 1, sizeof(data), f);
    fclose(f);
    cr_assert(bytes > 0 && bytes < sizeof(data));
    size_t train_bytes = bytes - bytes / 10; /* the held-out tail */
    const int N = RB * RT;
    const size_t NC = (size_t)N * RC;
    struct moe_config mc;
    moe_config_defaults(&mc, RC, RE);
    mc.k = 2;
    struct moe_route r;
    cr_assert_eq(moe_route_init(&r, &mc, N), 0);
    struct gpt_scratch gs = {.bytes = gpt_scratch_bytes(&R.cfg, RB, RT)};
    gs.mem = malloc(gs.bytes);
    float *a = malloc((RL + 1) * NC * sizeof(float)), *x2 = malloc(NC * sizeof(float)),
          *ln = malloc(NC * sizeof(float)), *d = malloc(NC * sizeof(float)),
          *mean = malloc(N * sizeof(float)), *rstd = malloc(N * sizeof(float));
    int tokens[RB * RT], targets[RB * RT], used[RE];
    cr_assert(gs.mem && a && x2 && ln && d && mean && rstd);
    for (int step = 1; step <= steps; step++) {
        for (int b = 0; b < RB; b++) {
            uint64_t off = mix64((uint64_t)RSEED * 0x9e3779b97f4a7c15ull +
                                 (uint64_t)step * 1000003u + (uint64_t)b) %
                           (train_bytes - RT);
            for (int i = 0; i < RT; i++) {
                tokens[b * RT + i] = data[off + (size_t)i];
                targets[b * RT + i] = data[off + (size_t)i + 1];
            }
        }
        for (int i = 0; i < nall; i++) {
            memset(all[i]->g, 0, all[i]->d.numel * sizeof(float));
            all[i]->used = true;
        }
        cr_assert_eq(gpt_embed_forward(&R.cfg, RB, RT, R.wte.p, R.wpe.p, tokens, a), 0);
        float aux = 0;
        for (int k = 0; k < RL; k++) {
            struct gpt_block_params bp = {{0}};
            struct moe_expert_params ep[RE];
            for (int s = 0; s < 8; s++)
                bp.t[s] = R.blk[k][s].p;
            for (int e = 0; e < RE; e++)
                ep[e] = (struct moe_expert_params){R.ex[k][e][0].p, R.ex[k][e][1].p,
                                                   R.ex[k][e][2].p, R.ex[k][e][3].p};
            cr_assert_eq(gpt_attn_forward(&R.cfg, RB, RT, &bp, a + k * NC, x2, &gs), 0);
            float l_aux;
            cr_assert_eq(moe_sublock_forward(&mc, NULL, N, x2, bp.t[GPT_LN2_W], bp.t[GPT_LN2_B],
                                             R.gate[k].p, ep, a + (k + 1) * NC, &l_aux),
                         0);
            aux += l_aux;
        }
        double ss = 0;
        cr_assert_eq(gpt_head_backward(&R.cfg, RB, RT, R.lnfw.p, R.lnfb.p, R.wte.p, a + RL * NC,
                                       targets, d, R.lnfw.g, R.lnfb.g, R.wte.g, &loss[step - 1],
                                       &gs),
                     0);
        loss[step - 1] += RCOEF * aux;
        sumsq(&ss, &R.lnfw);
        sumsq(&ss, &R.lnfb);
        for (int k = RL - 1; k >= 0; k--) {
            struct gpt_block_params bp = {{0}};
            struct gpt_block_grads bg = {{0}};
            struct moe_expert_params ep[RE];
            struct moe_expert_grads eg[RE];
            for (int s = 0; s < 8; s++) {
                bp.t[s] = R.blk[k][s].p;
                bg.t[s] = R.blk[k][s].g;
            }
            for (int e = 0; e < RE; e++) {
                ep[e] = (struct moe_expert_params){R.ex[k][e][0].p, R.ex[k][e][1].p,
                                                   R.ex[k][e][2].p, R.ex[k][e][3].p};
                eg[e] = (struct moe_expert_grads){R.ex[k][e][0].g, R.ex[k][e][1].g,
                                                  R.ex[k][e][2].g, R.ex[k][e][3].g};
            }
            cr_assert_eq(gpt_attn_forward(&R.cfg, RB, RT, &bp, a + k * NC, x2, &gs), 0);
            /* The experts the route uses: the others have no gradient. */
            ops_layernorm_forward(ln, mean, rstd, x2, bp.t[GPT_LN2_W], bp.t[GPT_LN2_B],
                                  (size_t)N, RC);
            cr_assert_eq(moe_gate_forward(&mc, N, ln, R.gate[k].p, &r), 0);
            int nu = moe_route_experts_used(&r, used);
            for (int e = 0; e < RE; e++)
                for (int s = 0; s < 4; s++)
                    R.ex[k][e][s].used = false;
            cr_assert_eq(moe_sublock_backward(&mc, NULL, N, x2, bp.t[GPT_LN2_W], bp.t[GPT_LN2_B],
                                              R.gate[k].p, ep, d, RCOEF, d,
                                              bg.t[GPT_LN2_W], bg.t[GPT_LN2_B], R.gate[k].g, eg),
                         0);
            cr_assert_eq(gpt_attn_backward(&R.cfg, RB, RT, &bp, a + k * NC, d, d, &bg, &gs), 0);
            for (int j = 0; j < nu; j++)
                for (int s = 0; s < 4; s++) {
                    R.ex[k][used[j]][s].used = true;
                    sumsq(&ss, &R.ex[k][used[j]][s]);
                }
            for (int s = 0; s < 8; s++)
                sumsq(&ss, &R.blk[k][s]);
            sumsq(&ss, &R.gate[k]);
        }
        cr_assert_eq(gpt_embed_backward(&R.cfg, RB, RT, tokens, d, R.wte.g, R.wpe.g), 0);
        sumsq(&ss, &R.wte);
        sumsq(&ss, &R.wpe);
        float clip = adamw_clip_scale(0.0 + ss, 1.0f);
        struct adamw_hparams h;
        adamw_hparams_defaults(&h);
        h.lr = RLR;
        for (int i = 0; i < nall; i++) {
            if (!all[i]->used) continue;
            h.weight_decay = 0;
            cr_assert_eq(adamw_update(all[i]->p, all[i]->g, all[i]->m, all[i]->v,
                                      all[i]->d.numel, &h, step, clip),
                         0);
        }
    }
    for (int i = 0; i < nall; i++)
        rt_free(all[i]);
    moe_route_release(&r);
    free(gs.mem);
    free(a);
    free(x2);
    free(ln);
    free(d);
    free(mean);
    free(rstd);
}

Test(moe_train, the_losses_are_the_reference_bits_in_memory_and_on_nvme_and_go_down)
{
    struct step_line mem[3], nv[3], again[3];
    char swap[4096];
    const char *args = "--experts 4 --top-k 2 --precision fp32 --lr 3e-3";
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    cr_assert_eq(train_run("mem", NULL, args, 3, mem), 3);
    cr_assert_eq(train_run("nvme", swap, args, 3, nv), 3);
    cr_assert_eq(train_run("again", NULL, args, 3, again), 3);
    float ref[3];
    ref_losses(ref, 3);
    for (int s = 0; s < 3; s++) {
        char want[40];
        snprintf(want, sizeof(want), "%.9g", (double)ref[s]);
        cr_expect_str_eq(mem[s].loss, want, "step %d: the run's loss %s, the reference's %s",
                         s + 1, mem[s].loss, want);
        cr_expect_str_eq(mem[s].loss, nv[s].loss, "step %d: in memory %s, on NVMe %s", s + 1,
                         mem[s].loss, nv[s].loss);
        cr_expect_str_eq(mem[s].loss, again[s].loss, "step %d: run to run %s, %s", s + 1,
                         mem[s].loss, again[s].loss);
        cr_expect_eq(mem[s].experts, 8, "step %d: 4 experts x 2 blocks, not %d", s + 1,
                     mem[s].experts);
        cr_expect(mem[s].aux > 0, "step %d: no balancing loss", s + 1);
        cr_expect_eq(mem[s].read, 0, "in memory, nothing is read from NVMe");
    }
    cr_expect(strtod(mem[2].loss, NULL) < strtod(mem[0].loss, NULL), "the loss %s -> %s",
              mem[0].loss, mem[2].loss);
    for (int s = 0; s < 3; s++)
        cr_expect_str_eq(mem[s].digest, nv[s].digest, "step %d: the parameters' digests", s + 1);
}

Test(moe_train, a_resumed_run_goes_on_with_the_same_bits)
{
    struct step_line whole[3], tail[1];
    char swap[4096], swap2[4096], args[256];
    const char *moe = "--experts 4 --top-k 2 --precision fp32";
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    snprintf(swap2, sizeof(swap2), "%s/swap2", dir);
    cr_assert_eq(train_run("whole", swap, moe, 3, whole), 3);
    train_to("first", swap2, moe, 2);
    snprintf(args, sizeof(args), "%s --resume", moe);
    cr_assert_eq(train_run("rest", swap2, args, 3, tail), 1);
    cr_expect_str_eq(tail[0].loss, whole[2].loss, "step 3 resumed %s, whole %s", tail[0].loss,
                     whole[2].loss);
    cr_expect_str_eq(tail[0].digest, whole[2].digest);
}

Test(moe_train, nvme_reads_follow_the_experts_a_step_routes_to)
{
    struct step_line st[4];
    char swap[4096];
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    micro = 1; /* batch 1 of seq 8: 8 tokens a block */
    int n = train_run("reads", swap, "--experts 8 --top-k 1 --precision fp32", 4, st);
    cr_assert_eq(n, 4);
    /* One expert of dim 32: fc (128,32)+(128), proj (32,128)+(32) fp32, each tensor read in
     * 4 KiB units: 40 KiB; 8 per block, 2 blocks. The first step reads the experts it uses
     * (the device tier keeps them for the next). */
    unsigned long long one = 40 * 1024, all = 16 * one;
    cr_expect(st[0].read > 0 && st[0].read <= (unsigned long long)st[0].used * one,
              "step 1: %d experts used, %llu bytes read", st[0].used, st[0].read);
    bool fewer = false;
    for (int s = 0; s < n; s++) {
        cr_expect_eq(st[s].experts, 16);
        cr_expect(st[s].used >= 2 && st[s].used <= 16, "step %d: %d used", s + 1, st[s].used);
        if (st[s].used < st[s].experts) {
            fewer = true;
            cr_expect_lt(st[s].read, all, "step %d: %d of 16 experts used, %llu bytes read",
                         s + 1, st[s].used, st[s].read);
        }
    }
    cr_expect(fewer, "8 tokens over 8 experts in each of 2 blocks: some expert had none");
    /* The experts' fetches, each of a used expert's tensors, and their hits; asking for
     * them ahead of their turn (or not) changes nothing in the numbers. */
    struct step_line none[4];
    snprintf(swap, sizeof(swap), "%s/swap0", dir);
    cr_assert_eq(train_run("none", swap, "--experts 8 --top-k 1 --precision fp32 "
                                         "--expert-prefetch 0",
                           4, none),
                 4);
    for (int s = 0; s < n; s++) {
        cr_expect_geq(st[s].fetches, 8ull * (unsigned)st[s].used, "step %d: %llu fetches",
                      s + 1, st[s].fetches);
        cr_expect_leq(st[s].hits, st[s].fetches);
        cr_expect_str_eq(none[s].loss, st[s].loss, "step %d: without prefetch %s, with %s",
                         s + 1, none[s].loss, st[s].loss);
        cr_expect_str_eq(none[s].digest, st[s].digest);
    }
}

/* A run of `ranks` expert-parallel ranks (ZeRO stage `stage`, the experts split across the
 * ranks: moe.ep_size) with 4 experts top-2 on NVMe under swap, up to step `steps`, logged
 * to name.jsonl; its step lines into out. */
static int ep_run(const char *name, int ranks, int stage, const char *swap, const char *args,
                  int steps, struct step_line *out)
{
    char cfg[4096], log[4096], extra[2048], *o;
    snprintf(extra, sizeof(extra),
             "\"moe\": {\"num_experts\": 4, \"top_k\": 2, \"ep_size\": %d}, "
             "\"zero_optimization\": {\"stage\": %d, \"offload_param\": {\"device\": "
             "\"nvme\", \"nvme_path\": \"%s\"}},",
             ranks, stage, swap);
    config(cfg, sizeof(cfg), extra);
    snprintf(log, sizeof(log), "%s/%s.jsonl", dir, name);
    int r = run(&o,
                "launch -n %d -- %s train --config %s --data " DATA
                " --steps %d --precision fp32 --log %s %s",
                ranks, getenv("ZINF_BIN"), cfg, steps, log, args);
    cr_assert_eq(r, 0, "%s: %s", name, o);
    free(o);
    return read_log(log, out, steps);
}

/* The experts split across ranks: each rank routes its own micro-batch, the tokens travel
 * to their experts' owners, and an expert's gradient adds each source's in the
 * micro-batches' order: the losses and parameters of one rank accumulating them all, to
 * the bit, whatever the ranks, the ZeRO stage and the micro-batches per rank. A run saved
 * by 4 ranks goes on under 2 (the experts re-cut from their owners' folders) as the run
 * that never moved. */
Test(moe_train, expert_parallel_ranks_give_one_ranks_bits_and_resume_across_layouts)
{
    struct step_line one[3], two[3], four[2], rest[1];
    char s1[4096], s2[4096], s4[4096];
    micro = 1;
    snprintf(s1, sizeof(s1), "%s/s1", dir);
    snprintf(s2, sizeof(s2), "%s/s2", dir);
    snprintf(s4, sizeof(s4), "%s/s4", dir);
    cr_assert_eq(ep_run("one", 1, 0, s1, "--accumulate 4", 3, one), 3);
    cr_assert_eq(ep_run("two", 2, 1, s2, "--accumulate 2", 3, two), 3);
    cr_assert_eq(ep_run("four", 4, 2, s4, "--checkpoint-every 2", 2, four), 2);
    cr_assert_eq(ep_run("rest", 2, 2, s4, "--accumulate 2 --resume", 3, rest), 1);
    for (int s = 0; s < 3; s++) {
        cr_expect_str_eq(two[s].loss, one[s].loss, "step %d: 2 ranks %s, one rank %s", s + 1,
                         two[s].loss, one[s].loss);
        cr_expect_str_eq(two[s].digest, one[s].digest, "step %d: the parameters", s + 1);
        cr_expect_str_eq(two[s].norm, one[s].norm, "step %d: the gradient norm", s + 1);
        cr_expect_eq(two[s].used, one[s].used, "step %d: experts used, 2 ranks %d, one %d",
                     s + 1, two[s].used, one[s].used);
        cr_expect_eq(two[s].experts, 8);
        cr_expect(two[s].aux > 0);
        cr_expect_eq(two[s].aux, one[s].aux, "step %d: l_aux %g, one rank's %g", s + 1,
                     two[s].aux, one[s].aux);
    }
    for (int s = 0; s < 2; s++) {
        cr_expect_str_eq(four[s].loss, one[s].loss, "step %d: 4 ranks %s, one rank %s", s + 1,
                         four[s].loss, one[s].loss);
        cr_expect_str_eq(four[s].digest, one[s].digest, "step %d: the parameters", s + 1);
        cr_expect_str_eq(four[s].norm, one[s].norm, "step %d: the gradient norm", s + 1);
    }
    cr_expect_str_eq(rest[0].loss, one[2].loss, "step 3 resumed on 2 ranks %s, one rank %s",
                     rest[0].loss, one[2].loss);
    cr_expect_str_eq(rest[0].digest, one[2].digest);
}

/* Rank 1 of 2 dies in the checkpoint of step 2, after its folder's rename: the ranks'
 * checkpoints are all or none, and --resume goes on from a step both hold, with the bits of
 * the run that was never killed. */
Test(moe_train, an_expert_parallel_rank_killed_in_a_checkpoint_resumes_with_the_same_bits)
{
    struct step_line whole[3], rest[3];
    char sw[4096], sk[4096], cfg[4096], extra[8192], *o;
    micro = 1;
    snprintf(sw, sizeof(sw), "%s/whole", dir);
    snprintf(sk, sizeof(sk), "%s/killed", dir);
    cr_assert_eq(ep_run("whole", 2, 1, sw, "", 3, whole), 3);
    snprintf(extra, sizeof(extra),
             "\"moe\": {\"num_experts\": 4, \"top_k\": 2, \"ep_size\": 2}, "
             "\"zero_optimization\": {\"stage\": 1, \"offload_param\": {\"device\": "
             "\"nvme\", \"nvme_path\": \"%s\"}},",
             sk);
    config(cfg, sizeof(cfg), extra);
    setenv("ZINF_TEST_KILL_AT", "after-rename:1:3", 1);
    int rk = run(&o,
                 "launch -n 2 -- %s train --config %s --data " DATA
                 " --steps 3 --precision fp32 --checkpoint-every 1",
                 getenv("ZINF_BIN"), cfg);
    unsetenv("ZINF_TEST_KILL_AT");
    cr_assert_neq(rk, 0, "the killed run: %s", o);
    free(o);
    int n = ep_run("rest", 2, 1, sk, "--resume", 3, rest);
    cr_assert(n >= 1 && n <= 2, "%d steps after the resume", n);
    cr_expect_str_eq(rest[n - 1].loss, whole[2].loss, "step 3 resumed %s, whole %s",
                     rest[n - 1].loss, whole[2].loss);
    cr_expect_str_eq(rest[n - 1].digest, whole[2].digest);
}

/* MoE blocks in pipeline stages: 3 stages over 5 blocks, every other one MoE, 4
 * micro-batches on the 1F1B schedule, the parameters on NVMe; and 2 copies of 2 stages, the
 * experts split across the copies (ZeRO-1), 2 micro-batches each: the losses (their
 * balancing term summed over every stage's blocks in block order), the gradient norms, the
 * parameters and the experts used of one rank accumulating the 4, to the bit. */
Test(moe_train, pipeline_stages_with_moe_blocks_give_one_ranks_bits)
{
    struct step_line one[3], three[3], four[3];
    char cfg[4096], log[4096], extra[8192], *o;
    static const struct {
        int ranks, accum;
        const char *layout;
    } runs[] = {{1, 4, ""},
                {3, 4, "\"pipeline\": {\"stages\": 3}, "},
                {4, 2, "\"pipeline\": {\"stages\": 2}, "}};
    for (int k = 0; k < 3; k++) {
        snprintf(extra, sizeof(extra),
                 "\"gradient_accumulation_steps\": %d, \"moe\": {\"num_experts\": 4, "
                 "\"top_k\": 2, \"moe_every\": 2, \"ep_size\": %d}, %s\"zero_optimization\": "
                 "{\"stage\": 1, \"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
                 "\"%s/pp%d\"}},",
                 runs[k].accum, k == 2 ? 2 : 1, runs[k].layout, dir, k);
        micro = 1;
        config(cfg, sizeof(cfg), extra);
        snprintf(log, sizeof(log), "%s/pp%d.jsonl", dir, k);
        int r = run(&o,
                    "launch -n %d -- %s train --config %s --data " DATA
                    " --steps 3 --layers 5 --precision fp32 --log %s",
                    runs[k].ranks, getenv("ZINF_BIN"), cfg, log);
        cr_assert_eq(r, 0, "%d ranks: %s", runs[k].ranks, o);
        free(o);
        cr_assert_eq(read_log(log, k == 0 ? one : k == 1 ? three : four, 3), 3);
    }
    for (int s = 0; s < 3; s++) {
        cr_expect_str_eq(four[s].loss, one[s].loss, "step %d: 2 x 2 stages %s, one rank %s",
                         s + 1, four[s].loss, one[s].loss);
        cr_expect_str_eq(four[s].norm, one[s].norm, "step %d: the gradient norm", s + 1);
        cr_expect_str_eq(four[s].digest, one[s].digest, "step %d: the parameters", s + 1);
        cr_expect_eq(four[s].aux, one[s].aux);
        cr_expect_eq(four[s].used, one[s].used);
    }
    for (int s = 0; s < 3; s++) {
        cr_expect_str_eq(three[s].loss, one[s].loss, "step %d: 3 stages %s, one rank %s", s + 1,
                         three[s].loss, one[s].loss);
        cr_expect_str_eq(three[s].digest, one[s].digest, "step %d: the parameters", s + 1);
        cr_expect_str_eq(three[s].norm, one[s].norm, "step %d: the gradient norm %s, one rank's %s",
                         s + 1, three[s].norm, one[s].norm);
        cr_expect_eq(three[s].aux, one[s].aux, "step %d: l_aux %g, one rank's %g", s + 1,
                     three[s].aux, one[s].aux);
        cr_expect_eq(three[s].used, one[s].used);
        cr_expect_eq(three[s].experts, 12, "3 MoE blocks of 4 experts, not %d", three[s].experts);
    }
}

/* 16-bit weights (bf16, fp16): each set's weights widened to fp32 before the math, as the CPU
 * backend's dense blocks: 2 expert-parallel ranks give one rank's bits in each precision,
 * and the losses stay within the 16-bit rounding of the fp32 run's. */
Test(moe_train, bf16_and_fp16_weights_train_moe_blocks_with_one_ranks_bits)
{
    static const char *const prec[] = {"fp32", "bf16", "fp16"};
    struct step_line one[3][3], two[3];
    char s1[4096], s2[4096], args[256];
    micro = 1;
    for (int k = 0; k < 3; k++) {
        snprintf(s1, sizeof(s1), "%s/p1-%d", dir, k);
        snprintf(s2, sizeof(s2), "%s/p2-%d", dir, k);
        snprintf(args, sizeof(args), "--accumulate 2 --precision %s", prec[k]);
        cr_assert_eq(ep_run("one16", 1, 0, s1, args, 3, one[k]), 3);
        snprintf(args, sizeof(args), "--precision %s", prec[k]);
        cr_assert_eq(ep_run("two16", 2, 1, s2, args, 3, two), 3);
        for (int s = 0; s < 3; s++) {
            cr_expect_str_eq(two[s].loss, one[k][s].loss, "%s step %d: 2 ranks %s, one %s",
                             prec[k], s + 1, two[s].loss, one[k][s].loss);
            cr_expect_str_eq(two[s].digest, one[k][s].digest, "%s step %d", prec[k], s + 1);
            double a = strtod(one[k][s].loss, NULL), b = strtod(one[0][s].loss, NULL);
            cr_expect(fabs(a - b) <= 1e-2 * fabs(b), "%s step %d: %g against fp32's %g",
                      prec[k], s + 1, a, b);
            if (k > 0)
                cr_expect_str_neq(one[k][s].loss, one[0][s].loss, "%s step %d: fp32's bits",
                                  prec[k], s + 1);
        }
    }
}

/* LAMB, whose trust ratio sums each tensor's chunks: an expert's are its owner's alone, so
 * 2 expert-parallel ranks give one rank's bits with it too. */
Test(moe_train, lamb_on_expert_parallel_ranks_gives_one_ranks_bits)
{
    struct step_line one[3], two[3];
    char cfg[4096], log[4096], extra[1024], *o;
    micro = 1;
    for (int n = 1; n <= 2; n++) {
        snprintf(extra, sizeof(extra),
                 "\"optimizer\": {\"type\": \"Lamb\", \"params\": {\"lr\": 0.003}}, "
                 "\"moe\": {\"num_experts\": 4, \"top_k\": 2, \"ep_size\": %d}, "
                 "\"zero_optimization\": {\"stage\": 1},",
                 n);
        config(cfg, sizeof(cfg), extra);
        snprintf(log, sizeof(log), "%s/lamb%d.jsonl", dir, n);
        int r = run(&o,
                    "launch -n %d -- %s train --config %s --data " DATA
                    " --steps 3 --accumulate %d --precision fp32 --log %s",
                    n, getenv("ZINF_BIN"), cfg, 3 - n, log);
        cr_assert_eq(r, 0, "%d ranks: %s", n, o);
        free(o);
        cr_assert_eq(read_log(log, n == 1 ? one : two, 3), 3);
    }
    for (int s = 0; s < 3; s++) {
        cr_expect_str_eq(two[s].loss, one[s].loss, "step %d", s + 1);
        cr_expect_str_eq(two[s].digest, one[s].digest, "step %d: the parameters", s + 1);
    }
}
