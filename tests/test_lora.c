/*
 * test_lora.c - LoRA fine-tuning (gpt_lora.h, trainer_opts.lora, zinf train --lora-rank):
 * the block with adapters at B = 0 is the frozen block to the bit, forward and backward; the
 * adapters' gradients match finite differences; a run registers no gradient nor Adam state
 * for the frozen weights, leaves them bit for bit as they were, starts at the base model's
 * loss to the bit and lowers it; bad settings are refused naming the flag, and a resume
 * with other adapters than the saved run's; --export-lora writes PEFT's names and config. What PEFT and transformers make of the export:
 * tests/python/test_lora_peft.py.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "train/gpt.h"
#include "train/gpt_lora.h"
#include "train/trainer.h"
#include "zinf.h"

static char *dir;
static char data_path[4096];

static void setup(void)
{
    dir = test_tmpdir("lora");
    cr_assert_not_null(dir);
    test_write_training_text(dir, data_path, sizeof(data_path));
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
}

TestSuite(lora, .init = setup, .fini = teardown, .timeout = 120);

static float urand(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) * (1.0 / (1ull << 24))) * 2.0f - 1.0f;
}

static float *fill(size_t n, float scale, uint64_t *s)
{
    float *p = malloc(n * sizeof(float));
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = scale * urand(s);
    return p;
}

/* A small block with random weights and every target's adapters, B zero or random. */
struct fixture {
    struct gpt_config cfg;
    int B, T, r;
    float *blk, *ad[2 * GPT_LORA_NTARGETS], *ag[2 * GPT_LORA_NTARGETS], *x, *dout;
    struct gpt_block_params p;
    struct gpt_lora_params l;
    struct gpt_lora_grads g;
    struct gpt_scratch s, gs;
};

static void fixture_make(struct fixture *f, bool b_zero)
{
    uint64_t s = 42;
    *f = (struct fixture){.cfg = {.V = 256, .maxT = 8, .L = 1, .C = 16, .NH = 2}, .B = 2, .T = 5,
                          .r = 3};
    size_t C = 16, N = (size_t)f->B * f->T;
    f->blk = fill(gpt_block_num_params(&f->cfg), 0.2f, &s);
    gpt_block_params_at(&f->cfg, f->blk, &f->p);
    f->l = (struct gpt_lora_params){.r = f->r, .scale = 1.5f};
    for (int j = 0; j < GPT_LORA_NTARGETS; j++) {
        size_t out, in;
        gpt_lora_dims(&f->cfg, j, &out, &in);
        f->ad[2 * j] = fill((size_t)f->r * in, 0.3f, &s);
        f->ad[2 * j + 1] = fill(out * (size_t)f->r, b_zero ? 0.0f : 0.3f, &s);
        f->ag[2 * j] = calloc((size_t)f->r * in, sizeof(float));
        f->ag[2 * j + 1] = calloc(out * (size_t)f->r, sizeof(float));
        f->l.a[j] = f->ad[2 * j];
        f->l.b[j] = f->ad[2 * j + 1];
        f->g.a[j] = f->ag[2 * j];
        f->g.b[j] = f->ag[2 * j + 1];
    }
    f->x = fill(N * C, 1.0f, &s);
    f->dout = fill(N * C, 1.0f, &s);
    f->s.bytes = gpt_lora_scratch_bytes(&f->cfg, f->B, f->T, f->r);
    f->s.mem = malloc(f->s.bytes);
    f->gs.bytes = gpt_scratch_bytes(&f->cfg, f->B, f->T);
    f->gs.mem = malloc(f->gs.bytes);
    cr_assert(f->s.mem && f->gs.mem);
}

static void fixture_free(struct fixture *f)
{
    free(f->blk);
    for (int i = 0; i < 2 * GPT_LORA_NTARGETS; i++) {
        free(f->ad[i]);
        free(f->ag[i]);
    }
    free(f->x);
    free(f->dout);
    free(f->s.mem);
    free(f->gs.mem);
}

Test(lora, zero_b_is_the_frozen_block)
{
    struct fixture f;
    fixture_make(&f, true);
    size_t NC = (size_t)f.B * f.T * 16;
    float *y0 = malloc(NC * sizeof(float)), *y1 = malloc(NC * sizeof(float));
    float *d0 = malloc(NC * sizeof(float)), *d1 = malloc(NC * sizeof(float));
    float *gb = calloc(gpt_block_num_params(&f.cfg), sizeof(float));
    struct gpt_block_grads g;
    gpt_block_grads_at(&f.cfg, gb, &g);
    cr_assert_eq(gpt_block_forward(&f.cfg, f.B, f.T, &f.p, f.x, y0, &f.gs), 0);
    cr_assert_eq(gpt_lora_block_forward(&f.cfg, f.B, f.T, &f.p, &f.l, f.x, y1, &f.s), 0);
    cr_assert_eq(memcmp(y0, y1, NC * sizeof(float)), 0, "the forward differs at B = 0");
    cr_assert_eq(gpt_block_backward(&f.cfg, f.B, f.T, &f.p, f.x, f.dout, d0, &g, &f.gs), 0);
    cr_assert_eq(gpt_lora_block_backward(&f.cfg, f.B, f.T, &f.p, &f.l, f.x, f.dout, d1, &f.g, &f.s),
                 0);
    cr_assert_eq(memcmp(d0, d1, NC * sizeof(float)), 0, "the input gradient differs at B = 0");
    /* At B = 0 A gets no gradient, B does. */
    double sa = 0, sb = 0;
    for (size_t i = 0; i < (size_t)f.r * 16; i++)
        sa += fabs(f.ag[0][i]);
    for (size_t i = 0; i < 48 * (size_t)f.r; i++)
        sb += fabs(f.ag[1][i]);
    cr_expect_eq(sa, 0.0);
    cr_expect_gt(sb, 0.0);
    free(y0);
    free(y1);
    free(d0);
    free(d1);
    free(gb);
    fixture_free(&f);
}

Test(lora, bad_input)
{
    struct fixture f;
    fixture_make(&f, false);
    size_t NC = (size_t)f.B * f.T * 16;
    float *y = malloc(NC * sizeof(float));
    const float *keep = f.l.b[1];
    f.l.b[1] = NULL; /* an A without its B */
    cr_expect_eq(gpt_lora_block_forward(&f.cfg, f.B, f.T, &f.p, &f.l, f.x, y, &f.s), -EINVAL);
    f.l.b[1] = keep;
    struct gpt_scratch small = {.mem = f.s.mem, .bytes = f.s.bytes - 128};
    cr_expect_eq(gpt_lora_block_forward(&f.cfg, f.B, f.T, &f.p, &f.l, f.x, y, &small), -EINVAL);
    cr_expect_eq(gpt_lora_block_forward(&f.cfg, f.B, 9, &f.p, &f.l, f.x, y, &f.s), -EINVAL);
    cr_expect_eq(gpt_lora_block_backward(&f.cfg, f.B, f.T, &f.p, &f.l, f.x, f.dout, f.x, &f.g,
                                         &f.s),
                 -EINVAL, "d_in may not be x_in");
    f.g.a[2] = NULL;
    cr_expect_eq(gpt_lora_block_backward(&f.cfg, f.B, f.T, &f.p, &f.l, f.x, f.dout, y, &f.g, &f.s),
                 -EINVAL, "a target without its gradient");
    f.l.r = 0;
    cr_expect_eq(gpt_lora_block_forward(&f.cfg, f.B, f.T, &f.p, &f.l, f.x, y, &f.s), -EINVAL);
    cr_expect_eq(gpt_lora_scratch_bytes(&f.cfg, f.B, f.T, 0), 0);
    /* PEFT's names of GPT-2's linears. */
    char buf[32];
    cr_expect_eq(gpt_lora_parse_targets("c_attn"), 1 << GPT_LORA_QKV);
    cr_expect_eq(gpt_lora_parse_targets("c_proj"),
                 (1 << GPT_LORA_ATTN_PROJ) | (1 << GPT_LORA_MLP_PROJ));
    cr_expect_eq(gpt_lora_parse_targets("c_fc,c_attn,c_proj"), GPT_LORA_ALL);
    cr_expect_str_eq(gpt_lora_targets_name(GPT_LORA_ALL, buf, sizeof(buf)), "c_attn,c_proj,c_fc");
    static const char *const bad[] = {"", ",", "c_attn,", ",c_fc", "c_attn,,c_fc", "q_proj",
                                      "c_att", "c_attn "};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        cr_expect_eq(gpt_lora_parse_targets(bad[i]), -EINVAL, "'%s'", bad[i]);
    gpt_lora_name(11, GPT_LORA_MLP_PROJ, 1, buf, sizeof(buf));
    cr_expect_str_eq(buf, "h11.mlp.proj.lora_b");
    free(y);
    fixture_free(&f);
}

/* sum(y * dout) of the block with adapters, in double. */
static double objective(struct fixture *f, float *y)
{
    cr_assert_eq(gpt_lora_block_forward(&f->cfg, f->B, f->T, &f->p, &f->l, f->x, y, &f->s), 0);
    double o = 0;
    for (size_t i = 0; i < (size_t)f->B * f->T * 16; i++)
        o += (double)y[i] * f->dout[i];
    return o;
}

Test(lora, adapter_gradients_match_finite_differences)
{
    struct fixture f;
    fixture_make(&f, false);
    size_t NC = (size_t)f.B * f.T * 16;
    float *y = malloc(NC * sizeof(float)), *d = malloc(NC * sizeof(float));
    cr_assert_eq(gpt_lora_block_backward(&f.cfg, f.B, f.T, &f.p, &f.l, f.x, f.dout, d, &f.g, &f.s),
                 0);
    const float h = 1e-2f;
    for (int i = 0; i < 2 * GPT_LORA_NTARGETS; i++)
        for (size_t e = 0; e < 5; e++) {
            size_t at = e * 7; /* every tensor has at least 48 elements */
            float keep = f.ad[i][at];
            f.ad[i][at] = keep + h;
            double up = objective(&f, y);
            f.ad[i][at] = keep - h;
            double down = objective(&f, y);
            f.ad[i][at] = keep;
            double num = (up - down) / (2 * h), got = f.ag[i][at];
            cr_expect(fabs(num - got) <= 2e-2 * fmax(1.0, fabs(num)),
                      "adapter %d element %zu: backward %g, finite difference %g", i, at, got, num);
        }
    free(y);
    free(d);
    fixture_free(&f);
}

static void write_config(const char *path, const char *swap)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": "
            "\"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}}, "
            "\"aio\": {\"block_size\": 65536, \"queue_depth\": 4}, \"zinf\": {\"device\": "
            "\"emulated\", \"device_bytes\": \"4M\", \"host_bytes\": \"4M\"}}",
            swap, swap);
    fclose(f);
}

static struct trainer_opts small(const char *tag, char *cfg, size_t n)
{
    char swap[4096];
    snprintf(swap, sizeof(swap), "%s/%s", dir, tag);
    snprintf(cfg, n, "%s/%s.json", dir, tag);
    write_config(cfg, swap);
    struct trainer_opts o;
    trainer_opts_defaults(&o);
    o.config_path = cfg;
    o.data_path = data_path;
    o.model.L = 2;
    o.model.C = 32;
    o.model.NH = 2;
    o.seq = 16;
    o.batch = 4;
    o.steps = 30;
    o.lr = 1e-2f;
    o.seed = 11;
    return o;
}

/* Tensor name's fp32 parameters (n floats), read from the engine. */
static float *read_p(struct trainer *t, const char *name, size_t n)
{
    char full[64];
    zinf_tensor h;
    float *v = malloc(n * sizeof(float));
    cr_assert_not_null(v);
    snprintf(full, sizeof(full), "p.%s", name);
    cr_assert_eq(zinf_lookup(trainer_engine(t), full, &h), 0, "%s", full);
    cr_assert_eq(zinf_read(trainer_engine(t), h, 0, v, n * sizeof(float)), 0);
    return v;
}

static void frozen_run(enum trainer_precision prec)
{
    char cfg[4096], err[512];
    struct trainer_opts base = small("base", cfg, sizeof(cfg));
    base.precision = prec;
    struct trainer *t;
    struct trainer_step_stats st;
    cr_assert_eq(trainer_open(&base, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_step(t, &st), 0);
    float base_loss = st.loss;
    struct trainer_summary full;
    trainer_get_summary(t, &full);
    trainer_close(t);

    char cfg2[4096];
    struct trainer_opts o = small("lora", cfg2, sizeof(cfg2));
    o.precision = prec;
    o.lora = (struct trainer_lora){.r = 4, .alpha = 8, .targets = GPT_LORA_ALL};
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    zinf_engine *e = trainer_engine(t);
    zinf_tensor h;
    /* No gradient, m or v for a frozen weight; all of them for an adapter. */
    static const char *const frozen[] = {"g.wte", "m.wte", "v.wpe", "g.h0.attn.qkv.w",
                                         "m.h1.mlp.proj.w", "v.lnf.b", "g.h1.ln2.w"};
    for (size_t i = 0; i < sizeof(frozen) / sizeof(frozen[0]); i++)
        cr_expect_eq(zinf_lookup(e, frozen[i], &h), -ENOENT, "%s is registered", frozen[i]);
    static const char *const trained[] = {"p.h0.attn.qkv.lora_a", "g.h0.attn.qkv.lora_a",
                                          "m.h1.mlp.proj.lora_b", "v.h1.mlp.fc.lora_b"};
    for (size_t i = 0; i < sizeof(trained) / sizeof(trained[0]); i++)
        cr_expect_eq(zinf_lookup(e, trained[i], &h), 0, "%s is not registered", trained[i]);
    struct trainer_summary sum;
    trainer_get_summary(t, &sum);
    cr_expect_lt(sum.model_state_bytes, full.model_state_bytes / 2,
                 "model state %llu with LoRA, %llu without", (unsigned long long)sum.model_state_bytes,
                 (unsigned long long)full.model_state_bytes);
    cr_expect_lt(sum.trainable_count, sum.param_count / 4);

    struct gpt_config gc = o.model;
    gc.maxT = o.seq;
    int n = gpt_layout(&gc, NULL, 0);
    struct gpt_tensor_desc *d = calloc((size_t)n, sizeof(*d));
    cr_assert_not_null(d);
    gpt_layout(&gc, d, (size_t)n);
    float **before = calloc((size_t)n, sizeof(float *));
    for (int i = 0; i < n; i++)
        before[i] = read_p(t, d[i].name, d[i].numel);
    float first = 0, last = 0;
    for (int s = 1; s <= o.steps; s++) {
        cr_assert_eq(trainer_step(t, &st), 0, "step %d", s);
        if (s == 1) {
            cr_expect_eq(st.loss, base_loss, "step 1: %.9g with B = 0, the base model's %.9g",
                         st.loss, base_loss);
        }
        if (s <= 3) first += st.loss / 3;
        if (s > o.steps - 3) last += st.loss / 3;
    }
    cr_expect_lt(last, first - 0.1f, "the loss went from %g to %g", first, last);
    cr_assert_eq(trainer_finish_update(t), 0);
    for (int i = 0; i < n; i++) {
        float *now = read_p(t, d[i].name, d[i].numel);
        cr_expect_eq(memcmp(now, before[i], d[i].numel * sizeof(float)), 0,
                     "frozen %s changed", d[i].name);
        free(now);
        free(before[i]);
    }
    /* The adapters moved. */
    float *b = read_p(t, "h0.attn.qkv.lora_b", 96 * 4);
    double sb = 0;
    for (int i = 0; i < 96 * 4; i++)
        sb += fabs(b[i]);
    cr_expect_gt(sb, 0.0);
    free(b);
    free(before);
    free(d);
    trainer_close(t);
}

Test(lora, frozen_base_fp32)
{
    frozen_run(TRAINER_PRECISION_FP32);
}

Test(lora, frozen_base_bf16)
{
    frozen_run(TRAINER_PRECISION_BF16);
}

Test(lora, bad_settings_refused)
{
    char cfg[4096], err[512];
    struct trainer *t = NULL;
    static const struct {
        struct trainer_lora l;
        int accum, experts;
        const char *says;
    } bad[] = {
        {{.r = -1, .targets = 1}, 1, 0, "--lora-rank -1"},
        {{.r = 4000, .targets = 1}, 1, 0, "--lora-rank 4000"},
        {{.r = 4, .alpha = -1, .targets = 1}, 1, 0, "--lora-alpha"},
        {{.r = 4, .targets = 0}, 1, 0, "--lora-targets"},
        {{.r = 4, .targets = 1, .dropout = 0.1f}, 1, 0, "--lora-dropout"},
        {{.r = 4, .targets = 1}, 2, 0, "gradient_accumulation_steps"},
        {{.r = 4, .targets = 1}, 1, 4, "--experts"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct trainer_opts o = small("bad", cfg, sizeof(cfg));
        o.lora = bad[i].l;
        o.grad_accum = bad[i].accum;
        o.moe.E = bad[i].experts;
        err[0] = 0;
        cr_expect_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL, "case %zu opened", i);
        cr_expect(strstr(err, bad[i].says), "case %zu: '%s' does not say %s", i, err, bad[i].says);
    }
}

#define MODEL "--layers 1 --dim 32 --heads 2 --seq 16 --batch 2"

Test(lora, cli_flags_and_export)
{
    char cfg[4096], *out = NULL;
    struct trainer_opts o = small("cli", cfg, sizeof(cfg));
    (void)o;
    static const struct {
        const char *args, *says;
    } bad[] = {
        {"--lora-rank 0", "--lora-rank: expected an integer"},
        {"--lora-rank 4 --lora-targets c_foo", "--lora-targets: expected"},
        {"--lora-rank 4 --lora-targets c_attn,", "--lora-targets: expected"},
        {"--lora-rank 4 --lora-dropout 0.1", "--lora-dropout 0.1"},
        {"--export-lora x", "--export-lora x: the run trains no adapters"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = test_run_zinf(&out, "train --config %s --data %s " MODEL " --steps 1 %s", cfg,
                               data_path, bad[i].args);
        cr_expect_neq(rc, 0, "%s: exit 0", bad[i].args);
        cr_expect(strstr(out, bad[i].says), "%s: %s", bad[i].args, out);
        free(out);
    }
    int rc = test_run_zinf(&out,
                           "train --config %s --data %s " MODEL " --steps 2 --lora-rank 2 "
                           "--lora-targets c_proj --lora-alpha 4 --export-lora %s/ad",
                           cfg, data_path, dir);
    cr_assert_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "# lora: rank 2, alpha 4, targets c_proj"), "%s", out);
    cr_expect(strstr(out, "# export-lora: step 2, 4 adapter tensors"), "%s", out);
    free(out);
    /* A resume trains the saved run's adapters, the same way as they were. */
    rc = test_run_zinf(&out, "train --config %s --data %s " MODEL " --steps 3 --resume", cfg,
                       data_path);
    cr_expect_eq(rc, 2, "%s", out);
    cr_expect(strstr(out, "the saved run trains LoRA adapters (--lora-rank 2 --lora-alpha 4 "
                          "--lora-targets c_proj); this run trains none"),
              "%s", out);
    free(out);
    rc = test_run_zinf(&out,
                       "train --config %s --data %s " MODEL " --steps 3 --resume --lora-rank 2 "
                       "--lora-targets c_proj --lora-alpha 4",
                       cfg, data_path);
    cr_expect_eq(rc, 0, "%s", out);
    free(out);
    char path[4200];
    snprintf(path, sizeof(path), "%s/ad/adapter_config.json", dir);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f);
    char text[2048] = {0};
    cr_assert_gt(fread(text, 1, sizeof(text) - 1, f), 0);
    fclose(f);
    cr_expect(strstr(text, "\"peft_type\": \"LORA\""), "%s", text);
    cr_expect(strstr(text, "\"fan_in_fan_out\": true"), "%s", text);
    cr_expect(strstr(text, "\"lora_alpha\": 4.0"), "%s", text);
    cr_expect(strstr(text, "\"c_proj\""), "%s", text);
    snprintf(path, sizeof(path), "%s/ad/adapter_model.safetensors", dir);
    f = fopen(path, "rb");
    cr_assert_not_null(f);
    char head[4096] = {0};
    cr_assert_gt(fread(head, 1, sizeof(head) - 1, f), 8);
    fclose(f);
    cr_expect(strstr(head + 8, "\"base_model.model.transformer.h.0.mlp.c_proj.lora_A.weight\":"
                               "{\"data_offsets\":[512,1536],\"dtype\":\"F32\",\"shape\":[2,128]}"),
              "%s", head + 8);
    cr_expect(strstr(head + 8, "\"base_model.model.transformer.h.0.attn.c_proj.lora_B.weight\""),
              "%s", head + 8);
}
