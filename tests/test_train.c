/*
 * test_train.c - the trainer through the engine: losses bitwise equal whatever the tiers
 * (everything in device memory vs budgets that force NVMe offload), a model whose state is
 * many times the budgets trains within them, and an interrupted run resumed gives the same
 * losses as an uninterrupted one. The same with bf16 weights on the device (mixed
 * precision on the CPU backend): the bf16 copies the optimizer refreshes are exactly the
 * fp32 masters rounded, whatever tier they went through.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common.h"
#include "helpers.h"
#include "engine/engine.h"
#include "io/uring.h"
#include "tiers/cuda_probe.h"
#include "train/backend.h"
#include "train/digest.h"
#include "train/gpt.h"
#include "train/loss_scale.h"
#include "train/ops.h"
#include "train/trainer.h"

#define STEPS 6

static char *dir;
static char data_path[4096];

static void setup(void)
{
    dir = test_tmpdir("train");
    cr_assert_not_null(dir);
    test_write_training_text(dir, data_path, sizeof(data_path));
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
}

TestSuite(train, .init = setup, .fini = teardown, .timeout = 300);

static void write_config(const char *path, const char *param_dev, const char *opt_dev,
                         const char *swap, const char *device_bytes, const char *host_bytes)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"stage\": 3,"
            " \"offload_param\": {\"device\": \"%s\"%s%s%s},"
            " \"offload_optimizer\": {\"device\": \"%s\"%s%s%s}},"
            " \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"%s\","
            " \"host_bytes\": \"%s\"}}",
            param_dev, swap ? ", \"nvme_path\": \"" : "", swap ? swap : "", swap ? "\"" : "",
            opt_dev, swap ? ", \"nvme_path\": \"" : "", swap ? swap : "", swap ? "\"" : "",
            device_bytes, host_bytes);
    fclose(f);
}

static struct trainer_opts small_model(const char *config)
{
    struct trainer_opts o;
    trainer_opts_defaults(&o);
    o.config_path = config;
    o.data_path = data_path;
    o.model.L = 6;
    o.model.C = 64;
    o.model.NH = 4;
    o.seq = 32;
    o.batch = 2;
    o.steps = STEPS;
    o.lr = 3e-3f;
    o.seed = 7;
    return o;
}

/* Step `step`'s stats: with the update deferred to the next forward, they say so and carry
 * the digest of the step before (none on the first step); else the step's own. dg[k - 1] is
 * the digest of step k. */
static void step_digest(const struct trainer_step_stats *st, int step, uint64_t *dg)
{
    if (!st->update_pending) {
        cr_assert(st->have_digest, "step %d: no digest", step);
        cr_assert_eq(st->digest_step, step);
        dg[step - 1] = st->digest;
        return;
    }
    cr_assert_eq(st->have_digest, step > 1, "step %d: a digest where none is due, or none",
                 step);
    if (step > 1) {
        cr_assert_eq(st->digest_step, step - 1, "step %d: the digest of step %d", step,
                     st->digest_step);
        dg[step - 2] = st->digest;
    }
}

/* After step `last`: its digest, finishing a deferred update. */
static void last_digest(struct trainer *t, int last, uint64_t *dg)
{
    struct trainer_summary s;
    cr_assert_eq(trainer_finish_update(t), 0);
    trainer_get_summary(t, &s);
    cr_assert(s.have_digest);
    cr_assert_eq(s.digest_step, last);
    dg[last - 1] = s.digest;
}

/* small_model() over a config of its own (cfg, of n bytes) whose swap directory is
 * dir/tag, with both offloads on NVMe. */
static struct trainer_opts nvme_model(char *cfg, size_t n, const char *tag, const char *dev,
                                      const char *host)
{
    char swap[4096];
    snprintf(swap, sizeof(swap), "%s/%s", dir, tag);
    snprintf(cfg, n, "%s/%s.json", dir, tag);
    write_config(cfg, "nvme", "nvme", swap, dev, host);
    return small_model(cfg);
}

static void run_steps(struct trainer_opts *o, int n, float *losses, struct trainer_summary *sum)
{
    struct trainer *t = NULL;
    char err[512];
    int r = trainer_open(o, &t, err, sizeof(err));
    cr_assert_eq(r, 0, "trainer_open: %s (%s)", err, zinf_strerror(r));
    for (int i = 0; i < n; i++) {
        struct trainer_step_stats st;
        int step = trainer_next_step(t);
        cr_assert_eq(trainer_step(t, &st), 0, "step %d", step);
        cr_assert_eq(st.step, step);
        losses[step - 1] = st.loss;
    }
    cr_assert_eq(trainer_checkpoint(t), 0);
    if (sum) trainer_get_summary(t, sum);
    trainer_close(t);
}

/* o's run stopped after `at` steps and resumed to STEPS: its losses into losses. */
static void run_interrupted(struct trainer_opts *o, int at, float *losses)
{
    o->steps = at;
    run_steps(o, at, losses, NULL);
    o->steps = STEPS;
    o->resume = true;
    run_steps(o, STEPS - at, losses, NULL);
}

static void expect_bitwise(const float *got, const float *want, const char *what)
{
    for (int i = 0; i < STEPS; i++)
        cr_expect(memcmp(&got[i], &want[i], sizeof(float)) == 0, "%s, step %d: %.9g, %.9g", what,
                  i + 1, got[i], want[i]);
}

/* The proof that no byte is lost or stale anywhere in the swap path. */
Test(train, losses_bitwise_equal_in_memory_and_offloaded)
{
    char cfg_mem[4096], cfg_nvme[4096], swap[4096];
    float a[STEPS], b[STEPS];
    struct trainer_summary sum;

    snprintf(cfg_mem, sizeof(cfg_mem), "%s/mem.json", dir);
    snprintf(cfg_nvme, sizeof(cfg_nvme), "%s/nvme.json", dir);
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    cr_assert_eq(mkdir(swap, 0755), 0);
    write_config(cfg_mem, "none", "none", NULL, "256M", "64M");

    struct trainer_opts o = small_model(cfg_mem);
    run_steps(&o, STEPS, a, NULL);

    /* Budgets far below the model's state: everything streams through NVMe. */
    write_config(cfg_nvme, "nvme", "nvme", swap, "600K", "1M");
    o = small_model(cfg_nvme);
    run_steps(&o, STEPS, b, &sum);

    for (int i = 0; i < STEPS; i++)
        cr_assert(memcmp(&a[i], &b[i], sizeof(float)) == 0,
                  "step %d: loss %.9g in memory, %.9g offloaded", i + 1, a[i], b[i]);
    cr_assert_lt(a[STEPS - 1], a[0], "the loss falls: %g -> %g", a[0], a[STEPS - 1]);
    cr_assert_geq(sum.model_state_bytes, 8 * sum.tier[ZINF_TIER_DEVICE].budget_bytes,
                  "the state (%llu) is >= 8x the device budget (%llu)",
                  (unsigned long long)sum.model_state_bytes,
                  (unsigned long long)sum.tier[ZINF_TIER_DEVICE].budget_bytes);
    cr_assert_geq(sum.model_state_bytes, 2 * sum.tier[ZINF_TIER_HOST].budget_bytes);
    for (int i = 0; i < 2; i++)
        cr_assert_leq(sum.tier[i].peak_bytes, sum.tier[i].budget_bytes, "tier %d: peak %llu > %llu",
                      i, (unsigned long long)sum.tier[i].peak_bytes,
                      (unsigned long long)sum.tier[i].budget_bytes);
}

/* Runs STEPS steps in one go and in two halves with a resume between, in precision p, and
 * asserts the losses are the same bits. Between the halves refuse(o) may try resumes that
 * must fail and change nothing. */
static void resume_equals_uninterrupted(enum trainer_precision p,
                                        void (*refuse)(const struct trainer_opts *o))
{
    char cfg[4096], swap1[4096], swap2[4096];
    float full[STEPS], parts[STEPS];

    snprintf(swap1, sizeof(swap1), "%s/s1", dir);
    snprintf(swap2, sizeof(swap2), "%s/s2", dir);
    cr_assert_eq(mkdir(swap1, 0755), 0);
    cr_assert_eq(mkdir(swap2, 0755), 0);
    snprintf(cfg, sizeof(cfg), "%s/c1.json", dir);
    write_config(cfg, "nvme", "cpu", swap1, "2M", "8M");
    struct trainer_opts o = small_model(cfg);
    o.precision = p;
    run_steps(&o, STEPS, full, NULL);

    snprintf(cfg, sizeof(cfg), "%s/c2.json", dir);
    write_config(cfg, "nvme", "cpu", swap2, "2M", "8M");
    o = small_model(cfg);
    o.precision = p;
    run_steps(&o, STEPS / 2, parts, NULL);
    o.resume = true;
    if (refuse) refuse(&o);
    run_steps(&o, STEPS - STEPS / 2, parts, NULL);

    for (int i = 0; i < STEPS; i++)
        cr_assert(memcmp(&full[i], &parts[i], sizeof(float)) == 0,
                  "step %d: %.9g uninterrupted, %.9g resumed", i + 1, full[i], parts[i]);
}

Test(train, resumed_run_gives_the_same_losses)
{
    resume_equals_uninterrupted(TRAINER_PRECISION_FP32, NULL);
}

Test(train, bad_input_is_refused_with_a_message)
{
    char cfg[4096], swap[4096], err[512];
    struct trainer *t = NULL;
    struct trainer_opts o;

    snprintf(swap, sizeof(swap), "%s/swap", dir);
    cr_assert_eq(mkdir(swap, 0755), 0);
    snprintf(cfg, sizeof(cfg), "%s/c.json", dir);
    write_config(cfg, "nvme", "nvme", swap, "64M", "64M");

    o = small_model(cfg);
    o.data_path = "/nonexistent/data.txt";
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -ENOENT);
    cr_assert(strstr(err, "/nonexistent/data.txt"), "%s", err);

    o = small_model(cfg);
    o.model.NH = 5;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "NH") || strstr(err, "head"), "%s", err);

    write_config(cfg, "nvme", "nvme", swap, "64K", "64M");
    o = small_model(cfg);
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "zinf.device_bytes"), "%s", err);

    write_config(cfg, "nvme", "nvme", swap, "64M", "64K");
    o = small_model(cfg);
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "zinf.host_bytes"), "%s", err);

    /* Resuming where nothing was saved. */
    write_config(cfg, "nvme", "nvme", swap, "64M", "64M");
    o = small_model(cfg);
    o.resume = true;
    cr_assert_lt(trainer_open(&o, &t, err, sizeof(err)), 0);
    cr_assert(strstr(err, "resume") || strstr(err, "train.state"), "%s", err);
    cr_assert_null(t);
}

/* Every bf16 copy equals its fp32 master rounded to nearest even: the optimizer wrote both
 * and the engine lost neither, whichever tiers they crossed. */
static void expect_bf16_copies_match(struct trainer_opts *o)
{
    struct trainer *t = NULL;
    char err[512];
    int r = trainer_open(o, &t, err, sizeof(err));
    cr_assert_eq(r, 0, "trainer_open: %s", err);
    zinf_engine *e = trainer_engine(t);
    const char *names[] = {"wte", "wpe", "h0.attn.qkv.w", "h5.mlp.proj.b", "lnf.w"};
    size_t C = (size_t)o->model.C, numel[] = {256 * C, (size_t)o->seq * C, 3 * C * C, C, C};
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++) {
        char pn[64], wn[64];
        zinf_tensor hp, hw;
        snprintf(pn, sizeof(pn), "p.%s", names[k]);
        snprintf(wn, sizeof(wn), "w.%s", names[k]);
        cr_assert_eq(zinf_lookup(e, pn, &hp), 0, "%s", pn);
        cr_assert_eq(zinf_lookup(e, wn, &hw), 0, "%s", wn);
        size_t n = numel[k];
        float *pf = malloc(n * sizeof(float));
        uint16_t *wf = malloc(n * sizeof(uint16_t));
        cr_assert_eq(zinf_read(e, hp, 0, pf, n * sizeof(float)), 0);
        cr_assert_eq(zinf_read(e, hw, 0, wf, n * sizeof(uint16_t)), 0);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(wf[i], ops_f32_to_bf16(pf[i]), "%s[%zu]: bf16 %#x, master %.9g", names[k],
                         i, wf[i], pf[i]);
        free(pf);
        free(wf);
    }
    trainer_close(t);
}

Test(train, bf16_weights_bitwise_equal_in_memory_and_offloaded)
{
    char cfg_mem[4096], cfg_nvme[4096], swap[4096], swap_mem[4096];
    float fp32[STEPS], a[STEPS], b[STEPS];
    struct trainer_summary sum;

    snprintf(cfg_mem, sizeof(cfg_mem), "%s/mem.json", dir);
    snprintf(cfg_nvme, sizeof(cfg_nvme), "%s/nvme.json", dir);
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    snprintf(swap_mem, sizeof(swap_mem), "%s/swap_mem", dir);
    cr_assert_eq(mkdir(swap, 0755), 0);
    cr_assert_eq(mkdir(swap_mem, 0755), 0);

    /* Everything resident, the optimizer on the device tier's memory. */
    write_config(cfg_mem, "none", "none", swap_mem, "256M", "64M");
    struct trainer_opts o = small_model(cfg_mem);
    o.precision = TRAINER_PRECISION_FP32;
    run_steps(&o, STEPS, fp32, NULL);
    /* A fresh swap directory for the bf16 run. */
    snprintf(swap_mem, sizeof(swap_mem), "%s/swap_mem2", dir);
    cr_assert_eq(mkdir(swap_mem, 0755), 0);
    write_config(cfg_mem, "none", "none", swap_mem, "256M", "64M");
    o = small_model(cfg_mem);
    o.precision = TRAINER_PRECISION_BF16;
    run_steps(&o, STEPS, a, &sum);
    cr_assert_str_eq(sum.precision, "bf16");
    cr_assert_str_eq(sum.backend, "cpu");

    /* Budgets far below the state: bf16 copies, masters and Adam states through NVMe. */
    write_config(cfg_nvme, "nvme", "nvme", swap, "800K", "1536K");
    o = small_model(cfg_nvme);
    o.precision = TRAINER_PRECISION_BF16;
    run_steps(&o, STEPS, b, &sum);

    for (int i = 0; i < STEPS; i++) {
        cr_assert(memcmp(&a[i], &b[i], sizeof(float)) == 0,
                  "step %d: loss %.9g in memory, %.9g offloaded", i + 1, a[i], b[i]);
        /* bf16 weights round each parameter to 8 bits of mantissa: the losses stay within a
         * few parts in a thousand of fp32's over these steps. */
        cr_assert_lt(fabsf(a[i] - fp32[i]), 0.01f * fp32[i], "step %d: bf16 %.6g, fp32 %.6g", i + 1,
                     a[i], fp32[i]);
    }
    cr_assert_lt(a[STEPS - 1], a[0], "the loss falls: %g -> %g", a[0], a[STEPS - 1]);
    cr_assert_geq(sum.model_state_bytes, 6 * sum.tier[ZINF_TIER_DEVICE].budget_bytes);
    cr_assert_geq(sum.model_state_bytes, 3 * sum.tier[ZINF_TIER_HOST].budget_bytes);
    for (int i = 0; i < 2; i++)
        cr_assert_leq(sum.tier[i].peak_bytes, sum.tier[i].budget_bytes);
    o.resume = true;
    expect_bf16_copies_match(&o);
}

/* The saved run is bf16: resuming it in fp32 is refused, saying so, and changes nothing. */
static void refuse_fp32(const struct trainer_opts *saved)
{
    struct trainer_opts o = *saved;
    struct trainer *t = NULL;
    char err[512];
    o.precision = TRAINER_PRECISION_FP32;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "--precision bf16"), "%s", err);
    cr_assert_null(t);
}

Test(train, bf16_resume_gives_the_same_losses_and_another_precision_is_refused)
{
    resume_equals_uninterrupted(TRAINER_PRECISION_BF16, refuse_fp32);
}

/* A training state written by another version (its magic differs) is refused with a
 * sentence saying so, and the tensors beside it are left as they were. */
Test(train, state_of_another_version_is_refused)
{
    char cfg[4096], swap[4096], err[512];
    float losses[STEPS];
    struct trainer *t = NULL;
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    cr_assert_eq(mkdir(swap, 0755), 0);
    snprintf(cfg, sizeof(cfg), "%s/c.json", dir);
    write_config(cfg, "nvme", "cpu", swap, "2M", "8M");
    struct trainer_opts o = small_model(cfg);
    run_steps(&o, 1, losses, NULL);

    o.resume = true;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    zinf_engine *e = trainer_engine(t);
    zinf_tensor st;
    uint64_t other = 0x7a696e6674726e31ull; /* "zinftrn1": the layout before precision */
    cr_assert_eq(zinf_lookup(e, "train.state", &st), 0);
    cr_assert_eq(zinf_write(e, st, 0, &other, sizeof(other)), 0);
    cr_assert_eq(zinf_flush(e), 0);
    trainer_close(t);

    t = NULL;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "another version of zinf train"), "%s", err);
    cr_assert_null(t);

    /* A state of the layout before the held-out tail ("zinftrn2", trained on the whole
     * file) resumes, and keeps its layout so that the next resume agrees too. */
    uint64_t v2 = 0x7a696e6674726e32ull;
    struct zinf_options zo = {.nvme_path = swap,
                              .device_bytes = 2 * MiB,
                              .host_bytes = 8 * MiB,
                              .block_size = 65536,
                              .queue_depth = 8,
                              .device_kind = ZINF_DEVICE_EMULATED,
                              .flags = ZINF_OPEN_RESUME | ZINF_OPEN_NO_PIN};
    zinf_engine *raw = NULL;
    cr_assert_eq(zinf_open(&zo, &raw), 0);
    cr_assert_eq(zinf_lookup(raw, "train.state", &st), 0);
    cr_assert_eq(zinf_write(raw, st, 0, &v2, sizeof(v2)), 0);
    zinf_close(raw);
    for (int k = 0; k < 2; k++) {
        struct trainer_step_stats ss;
        o.steps = 2 + k;
        cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "resume %d: %s", k + 1, err);
        cr_assert_eq(trainer_step(t, &ss), 0);
        cr_assert(isfinite(ss.loss));
        cr_assert_eq(trainer_checkpoint(t), 0);
        zinf_tensor h;
        uint64_t magic = 0;
        cr_assert_eq(zinf_lookup(trainer_engine(t), "train.state", &h), 0);
        cr_assert_eq(zinf_read(trainer_engine(t), h, 0, &magic, sizeof(magic)), 0);
        cr_assert_eq(magic, v2, "the earlier layout is kept");
        trainer_close(t);
        t = NULL;
    }
}

/* The backends refuse parameters the trainer would never pass, naming what is wrong. */
Test(train, backend_refuses_bad_parameters)
{
    struct backend_params p = {.cfg = {.V = 256, .maxT = 32, .L = 2, .C = 64, .NH = 4},
                               .B = 2,
                               .T = 32,
                               .wdt = BACKEND_BF16};
    struct backend *b = NULL;
    char err[256];
    cr_assert_eq(backend_cpu_open(&p, &b, err, sizeof(err)), 0, "%s", err);
    cr_assert_str_eq(b->name, "cpu");
    cr_assert_eq(b->wdt, BACKEND_BF16);
    cr_assert_eq(b->adt, BACKEND_F32);
    backend_close(b);

    struct backend_params bad = p;
    bad.T = 33;
    cr_assert_eq(backend_cpu_open(&bad, &b, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "seq 33") && strstr(err, "longest sequence 32"), "%s", err);
    cr_assert_null(b);
    bad = p;
    bad.B = 0;
    cr_assert_eq(backend_cpu_open(&bad, &b, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "batch 0"), "%s", err);
    bad = p;
    bad.wdt = (enum backend_dtype)7;
    cr_assert_eq(backend_cpu_open(&bad, &b, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "element type 7"), "%s", err);
    bad = p;
    bad.cfg.NH = 5;
    cr_assert_eq(backend_cpu_open(&bad, &b, err, sizeof(err)), -EINVAL);
    cr_assert(err[0], "a message for a head count that does not divide the width");
    /* The CUDA backend checks the same before touching a GPU, or says it was not built. */
    int r = backend_cuda_open(&bad, &b, err, sizeof(err));
    cr_assert(r == (backend_cuda_built() ? -EINVAL : -ENODEV), "%d", r);
    cr_assert_null(b);
    /* fp16 weights: both backends take them. Without a GPU the CUDA backend fails only for
     * want of one (or says it was not built), never for the element type. */
    bad = p;
    bad.wdt = BACKEND_F16;
    cr_assert_eq(backend_cpu_open(&bad, &b, err, sizeof(err)), 0, "%s", err);
    backend_close(b);
    b = NULL;
    struct cuda_probe_info ci;
    err[0] = 0;
    r = backend_cuda_open(&bad, &b, err, sizeof(err));
    if (!backend_cuda_built()) {
        cr_assert_eq(r, -ENODEV);
    } else if (cuda_probe(&ci) > 0) {
        cr_assert_eq(r, 0, "%s", err);
        cr_assert_eq(b->wdt, BACKEND_F16);
        cr_assert_eq(b->adt, BACKEND_F16);
        backend_close(b);
        b = NULL;
    } else {
        cr_assert_lt(r, 0);
        cr_assert(!strstr(err, "fp16"), "%s", err);
    }
    cr_assert_null(b);
}

Test(train, cuda_device_without_a_gpu_is_refused_with_a_message)
{
    struct cuda_probe_info ci;
    if (cuda_probe(&ci) > 0)
        cr_skip_test("a GPU is usable here: the CUDA trainer is tested in the gpu suite");
    char cfg[4096], swap[4096], err[512];
    struct trainer *t = NULL;
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    cr_assert_eq(mkdir(swap, 0755), 0);
    snprintf(cfg, sizeof(cfg), "%s/cuda.json", dir);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}}, \"zinf\": {\"device\": \"cuda\"}}",
            swap);
    fclose(f);
    struct trainer_opts o = small_model(cfg);
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -ENODEV);
    cr_assert(strstr(err, "zinf.device") && strstr(err, "cuda"), "%s", err);
    cr_assert_null(t);
}

/* A step whose IO fails returns the error and leaves the trainer usable. The failure comes
 * at the step's first NVMe request, before anything is written, so the steps that follow
 * give the same losses as a run that never failed. */
Test(train, failed_step_leaves_the_trainer_usable)
{
    char cfg[4096], swap[4096], err[512];
    float ref[STEPS], got[STEPS];
    struct trainer *t = NULL;
    struct trainer_step_stats st;

    snprintf(swap, sizeof(swap), "%s/ref", dir);
    cr_assert_eq(mkdir(swap, 0755), 0);
    snprintf(cfg, sizeof(cfg), "%s/ref.json", dir);
    write_config(cfg, "nvme", "nvme", swap, "600K", "1M");
    struct trainer_opts o = small_model(cfg);
    run_steps(&o, 4, ref, NULL);

    snprintf(swap, sizeof(swap), "%s/swap", dir);
    cr_assert_eq(mkdir(swap, 0755), 0);
    snprintf(cfg, sizeof(cfg), "%s/c.json", dir);
    write_config(cfg, "nvme", "nvme", swap, "600K", "1M");
    o = small_model(cfg);
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_step(t, &st), 0);
    got[0] = st.loss;
    /* Every read fails (a write-behind that fails is retried later, so a fault on "the next
     * chunk" may miss): the step fails, and once the drive is back the trainer goes on. */
    uring_fault_set(trainer_engine(t)->io, URING_FAULT_EIO_READ_STICKY, 1);
    cr_assert_eq(trainer_step(t, &st), -EIO);
    uring_fault_set(trainer_engine(t)->io, URING_FAULT_NONE, 0);
    cr_assert_eq(trainer_next_step(t), 2, "a failed step is not counted");
    for (int i = 1; i < 4; i++) {
        cr_assert_eq(trainer_step(t, &st), 0, "step %d after the failure", i + 1);
        got[i] = st.loss;
    }
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_close(t);
    for (int i = 0; i < 4; i++)
        cr_assert(memcmp(&ref[i], &got[i], sizeof(float)) == 0,
                  "step %d: %.9g never failed, %.9g after a failed step", i + 1, ref[i], got[i]);
}

/* A step that fails at any point either leaves the trainer usable (the failure came before
 * the optimizer changed anything) or, failing halfway through the optimizer, leaves the
 * state torn: then it refuses to go on, closes without flushing, and a resume starts from
 * the last checkpoint. Either way the losses that follow are those of a run that never
 * failed. (A torn state used to be flushed at close and resumed as if whole.) The faults:
 * an IO error at chunks spread over a step, one at three of its reads,
 * and a failed update of the optimizer's first,
 * middle and last tensor. */
#define FAULT_BUDGETS "300K", "512K"
static float fault_ref[4];
static struct trainer_opts fault_opts;
static bool fault_deferred; /* fault_opts defers each update to the next forward */

/* cfg (n bytes) := dir/TAG.json, the fault tests' config over the swap directory dir/TAG. */
static void fault_config(char *cfg, size_t n, const char *tag)
{
    char swap[4096];
    snprintf(swap, sizeof(swap), "%s/%s", dir, tag);
    snprintf(cfg, n, "%s/%s.json", dir, tag);
    write_config(cfg, "nvme", "nvme", swap, FAULT_BUDGETS);
}

/* fault_opts := the fault tests' small model over fault_config(TAG). */
static void fault_model(const char *tag)
{
    static char cfg[4096];
    fault_config(cfg, sizeof(cfg), tag);
    fault_opts = small_model(cfg);
    fault_opts.model.L = 2;
    fault_opts.model.C = 32;
    fault_opts.seq = 16;
}

/* The number of tensors of the fault tests' model (their layout indices: 0 .. n - 1). */
static int fault_tensors(void)
{
    struct gpt_config gc = fault_opts.model;
    gc.maxT = fault_opts.seq;
    return gpt_layout(&gc, NULL, 0);
}

/* One run: step 1, checkpoint, step 2 with the fault armed by arm(), then on to step 4
 * (fault_deferred: step 2 runs too, and step 3, whose forward runs step 2's update, has the
 * fault). Returns 1 when the fault tore the state, 0 when it left the trainer usable, -1
 * when the step did not fail. */
static int fault_run(unsigned k, void (*arm)(struct trainer *t, unsigned arg), unsigned arg)
{
    char cfg[4096], tag[32], err[512];
    float got[4];
    struct trainer *t = NULL;
    struct trainer_step_stats st;
    struct trainer_summary sum;
    struct trainer_opts o = fault_opts;

    snprintf(tag, sizeof(tag), "s%u", k);
    fault_config(cfg, sizeof(cfg), tag);
    o.config_path = cfg;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_step(t, &st), 0);
    got[0] = st.loss;
    cr_assert_eq(trainer_checkpoint(t), 0);
    int armed = 2;
    if (fault_deferred) {
        cr_assert_eq(trainer_step(t, &st), 0);
        cr_assert(st.update_pending, "case %u: the update is not deferred", k);
        got[1] = st.loss;
        armed = 3;
    }
    arm(t, arg);
    int r = trainer_step(t, &st);
    uring_fault_set(trainer_engine(t)->io, URING_FAULT_NONE, 0);
    trainer_get_summary(t, &sum);
    int next = armed;
    if (r == 0) {
        got[armed - 1] = st.loss; /* the fault hit no request the step needed */
        next = armed + 1;
    } else if (sum.torn) {
        next = 2;
        cr_assert_eq(trainer_step(t, &st), r, "a torn trainer refuses to step");
        cr_assert_eq(trainer_checkpoint(t), r, "and to checkpoint");
        trainer_close(t); /* without flushing: step 1's checkpoint stays */
        o.resume = true;
        cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    }
    cr_assert_eq(trainer_next_step(t), next, "case %u", k);
    for (int s = next; s <= 4; s++) {
        int x = trainer_step(t, &st);
        cr_assert_eq(x, 0, "case %u (the fault's step: %s): step %d after the fault: %s", k,
                     r == 0 ? "missed" : sum.torn ? "torn" : "failed", s, zinf_strerror(x));
        got[s - 1] = st.loss;
    }
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_close(t);
    for (int i = 0; i < 4; i++)
        cr_assert(memcmp(&fault_ref[i], &got[i], sizeof(float)) == 0,
                  "case %u (%s): step %d: %.9g never failed, %.9g", k,
                  r == 0     ? "missed"
                  : sum.torn ? "torn"
                             : "before the optimizer",
                  i + 1, fault_ref[i], got[i]);
    return r == 0 ? -1 : sum.torn ? 1 : 0;
}

static void arm_io(struct trainer *t, unsigned nth)
{
    uring_fault_set(trainer_engine(t)->io, URING_FAULT_EIO, nth);
}

static void arm_read(struct trainer *t, unsigned nth)
{
    uring_fault_set(trainer_engine(t)->io, URING_FAULT_EIO_READ, nth);
}

static void arm_optimizer(struct trainer *t, unsigned tensor)
{
    trainer_fault_optimizer(t, (int)tensor, EIO);
}

/* The write of the step's count fails (after its update, or after the update is deferred). */
static void arm_step_save(struct trainer *t, unsigned unused)
{
    (void)unused;
    trainer_fault_step_save(t, EIO);
}

/* Every read fails from now on, until fault_run clears the hook after the step. */
static void arm_reads_fail(struct trainer *t, unsigned unused)
{
    (void)unused;
    uring_fault_set(trainer_engine(t)->io, URING_FAULT_EIO_READ_STICKY, 1);
}

/* As the optimizer's phase begins: the nth read from there, or every read, or the nth
 * write (a write-behind of a set it released), while the pipeline has the next set's
 * reads and the last ones' write-backs in flight. */
static void arm_opt_read(struct trainer *t, unsigned nth)
{
    arm_read(t, nth);
}

static void arm_opt_reads_fail(struct trainer *t, unsigned unused)
{
    arm_reads_fail(t, unused);
}

static void arm_opt_write(struct trainer *t, unsigned nth)
{
    uring_fault_set(trainer_engine(t)->io, URING_FAULT_EIO_WRITE, nth);
}

static void arm_in_optimizer(struct trainer *t, unsigned which)
{
    static void (*const fn[])(struct trainer *, unsigned) = {arm_opt_reads_fail, arm_opt_read,
                                                             arm_opt_read, arm_opt_write,
                                                             arm_opt_write};
    static const unsigned arg[] = {1, 2, 5, 1, 3};
    trainer_fault_optimizer_begin(t, fn[which], arg[which]);
}

Test(train, step_failing_anywhere_continues_with_the_same_losses)
{
    char cfg[4096], err[512];
    struct trainer *t = NULL;
    struct trainer_step_stats st;

    fault_model("ref");
    fault_deferred = false;
    run_steps(&fault_opts, 4, fault_ref, NULL);

    /* How many IO chunks one step completes, to spread the faults over all of it. */
    fault_config(cfg, sizeof(cfg), "count");
    struct trainer_opts o = fault_opts;
    o.config_path = cfg;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_step(t, &st), 0);
    struct uring_stats u0, u1;
    uring_get_stats(trainer_engine(t)->io, &u0);
    cr_assert_eq(trainer_step(t, &st), 0);
    uring_get_stats(trainer_engine(t)->io, &u1);
    int ntensors = fault_tensors();
    trainer_close(t);
    unsigned chunks = (unsigned)(u1.chunks - u0.chunks);
    cr_assert_gt(chunks, 10, "a step does IO");

    int outcome[3] = {0}; /* missed, usable, torn */
    unsigned k = 0;
    for (unsigned i = 0; i < 5; i++, k++)
        outcome[1 + fault_run(k, arm_io, 1 + (unsigned)((uint64_t)i * (chunks - 1) / 4))]++;
    /* Which chunk an ordinal lands on depends on timing: a fault on a background write-back
     * is retried and misses, and so does one on a read the engine makes again (a prefetch
     * the fetch repeats). When every read fails, the first one the forward waits for fails
     * the step before the optimizer. */
    int got = fault_run(k++, arm_reads_fail, 0);
    cr_assert(got == 0, "every read of step 2 failing: %s",
              got < 0 ? "the step did not fail" : "the state tore");
    outcome[1 + got]++;
    unsigned reads[] = {2, chunks / 8}; /* a step reads about a fifth of its chunks */
    for (unsigned i = 0; i < 2; i++, k++)
        outcome[1 + fault_run(k, arm_read, reads[i])]++;
    cr_assert_gt(outcome[1], 0, "some IO faults failed the step before the optimizer");
    unsigned where[] = {0, (unsigned)ntensors / 2, (unsigned)ntensors - 1};
    for (unsigned i = 0; i < 3; i++, k++)
        cr_assert_eq(fault_run(k, arm_optimizer, where[i]), 1,
                     "a failed update of tensor %u "
                     "tears the state",
                     where[i]);
    /* Faults on what the optimizer's pipeline has in flight: every read failing from the
     * phase's start tears the state (its first set cannot be read); a read or a write-behind
     * failing later tears it or is retried, and either way the run goes on bitwise. */
    cr_assert_eq(fault_run(k++, arm_in_optimizer, 0), 1,
                 "every read failing in the optimizer tears the state");
    cr_assert_eq(fault_run(k++, arm_step_save, 0), 1,
                 "the count not written after the update tears the state");
    for (unsigned i = 1; i < 5; i++, k++) {
        int got_i = fault_run(k, arm_in_optimizer, i);
        cr_log_info("optimizer fault %u: %s", i,
                    got_i < 0 ? "missed" : got_i ? "torn" : "usable");
        cr_assert_neq(got_i, 0, "a fault in the optimizer cannot leave the state whole");
    }
    cr_log_info("IO faults over %u chunks: %d missed, %d before the optimizer, %d torn", chunks,
                outcome[0], outcome[1], outcome[2]);
}

/* The update deferred to the next forward (zinf.train.update_in_forward): the
 * same losses as the optimizer phase at the end of the step, and a fault anywhere in the
 * step that runs it (IO spread over the step, every read, the update of the first, middle
 * or last tensor, what its pipeline has in flight) fails that step and leaves the trainer
 * usable: the tensors updated stay so and the next try updates the others, the losses going
 * on bitwise. Only a close that cannot finish it tears the state, and the last checkpoint
 * stays the saved one. */
Test(train, deferred_update_failing_anywhere_goes_on_with_the_same_losses)
{
    char cfg[4096], err[512];
    float ref[4];
    struct trainer *t = NULL;
    struct trainer_step_stats st;
    struct trainer_summary sum;

    fault_model("dref");
    run_steps(&fault_opts, 4, ref, NULL);
    fault_model("dref2");
    fault_opts.update_in_forward = true;
    run_steps(&fault_opts, 4, fault_ref, &sum);
    cr_assert(sum.update_in_forward);
    for (int i = 0; i < 4; i++)
        cr_assert(!memcmp(&ref[i], &fault_ref[i], sizeof(float)),
                  "step %d: %.9g updated at the step's end, %.9g in the next forward", i + 1,
                  ref[i], fault_ref[i]);
    fault_deferred = true;

    int ntensors = fault_tensors(), outcome[3] = {0};
    unsigned k = 100;
    for (unsigned i = 0; i < 6; i++, k++)
        outcome[1 + fault_run(k, arm_io, 1 + 40 * i)]++;
    cr_assert_eq(fault_run(k++, arm_reads_fail, 0), 0, "every read failing");
    cr_assert_eq(fault_run(k++, arm_step_save, 0), 0,
                 "the count not written after the update was deferred leaves the trainer usable");
    unsigned where[] = {0, (unsigned)ntensors / 2, (unsigned)ntensors - 1};
    for (unsigned i = 0; i < 3; i++, k++)
        cr_assert_eq(fault_run(k, arm_optimizer, where[i]), 0,
                     "a failed update of tensor %u leaves the trainer usable", where[i]);
    for (unsigned i = 0; i < 5; i++, k++) {
        int got = fault_run(k, arm_in_optimizer, i);
        cr_assert_neq(got, 1, "fault %u in the deferred update tore the state", i);
        outcome[1 + got]++;
    }
    cr_assert_eq(outcome[2], 0, "an IO fault tore the state");
    cr_log_info("deferred update, IO faults: %d missed, %d failed the step", outcome[0],
                outcome[1]);

    /* A close that cannot finish the update: torn, and the resume goes on from step 1. */
    fault_config(cfg, sizeof(cfg), "dclose");
    struct trainer_opts o = fault_opts;
    o.config_path = cfg;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_step(t, &st), 0);
    cr_assert_eq(trainer_checkpoint(t), 0);
    cr_assert_eq(trainer_step(t, &st), 0);
    cr_assert(st.update_pending);
    trainer_fault_optimizer(t, ntensors / 2, EIO);
    trainer_close(t);
    o.resume = true;
    t = NULL;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_next_step(t), 2, "the torn step 2 was not saved");
    for (int s = 2; s <= 4; s++) {
        cr_assert_eq(trainer_step(t, &st), 0);
        cr_assert(!memcmp(&st.loss, &fault_ref[s - 1], sizeof(float)),
                  "step %d after the torn close", s);
    }
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_close(t);
}

/* What finishes an update deferred to the next forward, against the update at the step's
 * end: a validation (after step 2), a sample (after step 3) and a checkpoint (after step 4)
 * each run it first, and see and leave the same parameters (the same loss, bytes and
 * digests). A checkpoint whose finishing update fails returns the error, writes nothing and
 * leaves the trainer usable: the next one finishes the update and saves, and a resume from
 * it goes on bitwise. */
struct pend_run {
    float loss[5], eval2;
    unsigned char sample3[12]; /* after a 1-byte prompt, within the seq of 16 */
    uint64_t dg[4];
};

static void pend_digest(struct trainer *t, int step, uint64_t *dg)
{
    struct trainer_summary s;
    trainer_get_summary(t, &s);
    cr_assert(s.have_digest);
    cr_assert_eq(s.digest_step, step, "the digest of step %d, not %d", s.digest_step, step);
    dg[step - 1] = s.digest;
}

static void pend_run(const char *tag, bool in_forward, struct pend_run *out)
{
    char err[512];
    struct trainer *t = NULL;
    struct trainer_step_stats st;
    struct trainer_summary sum;
    fault_model(tag);
    struct trainer_opts o = fault_opts;
    o.update_in_forward = in_forward;
    o.digest = true;
    o.sample = true;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    for (int s = 1; s <= 4; s++) {
        cr_assert_eq(trainer_step(t, &st), 0, "%s: step %d", tag, s);
        out->loss[s - 1] = st.loss;
        cr_assert_eq(st.update_pending, in_forward);
        if (s == 2) {
            cr_assert_eq(trainer_eval(t, 3, &out->eval2), 0);
            pend_digest(t, 2, out->dg);
        } else if (s == 3) {
            cr_assert_eq(trainer_sample(t, 9, (const unsigned char *)"\n", 1, out->sample3,
                                        sizeof(out->sample3)),
                         (int)sizeof(out->sample3));
            pend_digest(t, 3, out->dg);
        }
    }
    if (in_forward) {
        trainer_get_summary(t, &sum);
        int saved = sum.checkpoint_step;
        trainer_fault_optimizer(t, fault_tensors() / 2, EIO);
        cr_assert_eq(trainer_checkpoint(t), -EIO, "the finishing update fails the checkpoint");
        trainer_get_summary(t, &sum);
        cr_assert_eq(sum.checkpoint_step, saved, "a failed checkpoint saved step %d",
                     sum.checkpoint_step);
        cr_assert(!sum.torn, "a failed finishing update tore the state");
        cr_assert_eq(sum.digest_step, 3, "half an update counted as done");
    }
    cr_assert_eq(trainer_checkpoint(t), 0);
    pend_digest(t, 4, out->dg);
    trainer_close(t);
    o.resume = true;
    t = NULL;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_next_step(t), 5);
    cr_assert_eq(trainer_step(t, &st), 0);
    out->loss[4] = st.loss;
    trainer_close(t);
}

Test(train, eval_sample_and_checkpoint_finish_a_deferred_update)
{
    static struct pend_run end, fwd;
    pend_run("pend-end", false, &end);
    pend_run("pend-fwd", true, &fwd);
    for (int i = 0; i < 5; i++)
        cr_assert(!memcmp(&end.loss[i], &fwd.loss[i], sizeof(float)),
                  "step %d: %.9g at the step's end, %.9g in the next forward", i + 1, end.loss[i],
                  fwd.loss[i]);
    cr_assert(!memcmp(&end.eval2, &fwd.eval2, sizeof(float)), "validation: %.9g, %.9g",
              end.eval2, fwd.eval2);
    cr_assert_eq(memcmp(end.sample3, fwd.sample3, sizeof(end.sample3)), 0, "the sample");
    for (int i = 1; i < 4; i++)
        cr_assert_eq(end.dg[i], fwd.dg[i], "the digest of step %d", i + 1);
}

/* The optimizer's pipeline: with it (the default) and without it (pipeline_read and
 * pipeline_write false), and in memory, the same losses and parameter digests bit for bit.
 * With it, sets are asked for ahead and the engine writes released sets behind; without it,
 * neither. At the smallest budgets that run (one set in the host tier), every step still
 * runs: a set ahead that finds no room is fetched again alone, and the bits do not change. */
struct pipe_run {
    float loss[STEPS];
    uint64_t digest[STEPS];
    struct trainer_summary sum;
    uint64_t write_behinds;
};

static void pipe_run(const char *tag, const char *offload, const char *dev, const char *host,
                     const char *extra, bool in_forward, struct pipe_run *out)
{
    char cfg[4096], swap[4096], err[512];
    struct trainer *t = NULL;
    struct trainer_step_stats st;
    struct zinf_stats zs;
    snprintf(swap, sizeof(swap), "%s/%s", dir, tag);
    snprintf(cfg, sizeof(cfg), "%s/%s.json", dir, tag);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"offload_param\": {\"device\": \"%s\", "
            "\"nvme_path\": \"%s\"},"
            " \"offload_optimizer\": {\"device\": \"%s\", \"nvme_path\": \"%s\"%s}},"
            " \"aio\": {\"block_size\": 65536, \"queue_depth\": 8},"
            " \"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"%s\","
            " \"host_bytes\": \"%s\"}}",
            offload, swap, offload, swap, extra, dev, host);
    fclose(f);
    struct trainer_opts o = small_model(cfg);
    o.digest = true;
    o.update_in_forward = in_forward;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s: %s", tag, err);
    for (int s = 0; s < STEPS; s++) {
        cr_assert_eq(trainer_step(t, &st), 0, "%s: step %d", tag, s + 1);
        step_digest(&st, s + 1, out->digest);
        out->loss[s] = st.loss;
    }
    last_digest(t, STEPS, out->digest);
    trainer_get_summary(t, &out->sum);
    cr_assert_eq(zinf_stats(trainer_engine(t), &zs), 0);
    out->write_behinds = zs.write_behinds;
    trainer_close(t);
}

/* Each gradient is released as spent (ZINF_RELEASE_ZERO) once its update has read it: it
 * reads as zeros until the next backward writes it. One that another caller holds then is
 * released clean instead: it keeps its content, the step goes on, and the losses are those
 * of a run that nobody disturbed. At the step's end and in the next forward. */
static bool reads_as_zeros(zinf_engine *e, const char *name)
{
    zinf_tensor h;
    struct zinf_tensor_info info;
    cr_assert_eq(zinf_lookup(e, name, &h), 0, "%s", name);
    cr_assert_eq(zinf_tensor_info(e, h, &info), 0);
    float *f = malloc(info.bytes);
    cr_assert_eq(zinf_read(e, h, 0, f, info.bytes), 0);
    bool zero = true;
    for (size_t i = 0; i < info.bytes / sizeof(float); i++)
        zero &= f[i] == 0.0f;
    free(f);
    return zero;
}

Test(train, spent_gradients_read_as_zeros_and_a_held_one_keeps_its_content)
{
    for (int fwd = 0; fwd < 2; fwd++) {
        char cfg[4096], tag[32];
        float ref[STEPS], got[STEPS];
        snprintf(tag, sizeof(tag), "spent-ref%d", fwd);
        struct trainer_opts o = nvme_model(cfg, sizeof(cfg), tag, "8M", "3M");
        o.update_in_forward = fwd;
        run_steps(&o, STEPS, ref, NULL);

        snprintf(tag, sizeof(tag), "spent%d", fwd);
        o = nvme_model(cfg, sizeof(cfg), tag, "8M", "3M");
        o.update_in_forward = fwd;
        struct trainer *t = NULL;
        char err[512];
        cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "trainer_open: %s", err);
        zinf_engine *e = trainer_engine(t);
        zinf_tensor held;
        void *p;
        for (int s = 1; s <= STEPS; s++) {
            struct trainer_step_stats st;
            if (s == 2) { /* held through step 2's update */
                cr_assert_eq(zinf_lookup(e, "g.h0.mlp.fc.w", &held), 0);
                cr_assert_eq(zinf_fetch(e, held, ZINF_TIER_DEVICE, &p), 0);
            }
            cr_assert_eq(trainer_step(t, &st), 0, "%s: step %d", fwd ? "in forward" : "at end",
                         s);
            got[s - 1] = st.loss;
            if (s > 2) continue;
            cr_assert_eq(trainer_finish_update(t), 0);
            cr_assert(reads_as_zeros(e, "g.h0.attn.qkv.w"),
                      "fwd %d, step %d: a gradient its update read is not zeros", fwd, s);
            if (s == 2) {
                cr_assert(!reads_as_zeros(e, "g.h0.mlp.fc.w"),
                          "fwd %d: the held gradient was zeroed under its holder", fwd);
                cr_assert_eq(zinf_release(e, held, ZINF_TIER_DEVICE, 0), 0);
            }
        }
        trainer_close(t);
        expect_bitwise(got, ref, fwd ? "in forward, a gradient held" : "at end, a gradient held");
    }
}

Test(train, optimizer_pipeline_changes_no_bits)
{
    static struct pipe_run mem, on, off, tight, fwd, fwd_tight;
    pipe_run("mem", "none", "64M", "64M", "", false, &mem);
    pipe_run("on", "nvme", "600K", "1M", "", false, &on);
    pipe_run("off", "nvme", "600K", "1M", ", \"pipeline_read\": false, \"pipeline_write\": false",
             false, &off);
    char dev[32], host[32];
    snprintf(dev, sizeof(dev), "%llu", (unsigned long long)on.sum.min_budget[0]);
    snprintf(host, sizeof(host), "%llu", (unsigned long long)on.sum.min_budget[1]);
    pipe_run("tight", "nvme", dev, host, "", false, &tight);
    pipe_run("fwd", "nvme", "600K", "1M", "", true, &fwd);
    pipe_run("fwd-tight", "nvme", dev, host, "", true, &fwd_tight);
    cr_assert(fwd.sum.update_in_forward && fwd_tight.sum.update_in_forward);
    cr_assert(!on.sum.update_in_forward);
    const struct pipe_run *runs[] = {&on, &off, &tight, &fwd, &fwd_tight};
    const char *names[] = {"pipelined", "not pipelined", "pipelined at the smallest budgets",
                           "the update in the next forward",
                           "the update in the next forward at the smallest budgets"};
    for (int k = 0; k < 5; k++)
        for (int s = 0; s < STEPS; s++) {
            cr_assert(memcmp(&runs[k]->loss[s], &mem.loss[s], sizeof(float)) == 0,
                      "%s, step %d: loss %.9g, in memory %.9g", names[k], s + 1,
                      runs[k]->loss[s], mem.loss[s]);
            cr_assert_eq(runs[k]->digest[s], mem.digest[s], "%s, step %d: digest %016llx, "
                         "in memory %016llx", names[k], s + 1,
                         (unsigned long long)runs[k]->digest[s],
                         (unsigned long long)mem.digest[s]);
        }
    cr_assert_gt(on.sum.pipeline_ahead, 0, "the pipeline asked for no set ahead");
    cr_assert_gt(on.write_behinds, 0, "no released set was written behind");
    cr_assert_eq(off.sum.pipeline_ahead, 0);
    cr_assert_eq(off.write_behinds, 0);
    cr_assert_gt(tight.sum.pipeline_ahead, 0);
    cr_log_info("pipeline: %llu sets ahead (%llu fetched again), %llu write-behinds; at the "
                "smallest budgets %llu ahead, %llu fetched again",
                (unsigned long long)on.sum.pipeline_ahead,
                (unsigned long long)on.sum.pipeline_refetched,
                (unsigned long long)on.write_behinds,
                (unsigned long long)tight.sum.pipeline_ahead,
                (unsigned long long)tight.sum.pipeline_refetched);
}

/* A checkpoint writes only what changed since the last one: one right after another writes
 * the step count's page alone, and each says what it wrote. */
Test(train, checkpoint_writes_only_what_changed)
{
    char cfg[4096], swap[4096], err[512];
    struct trainer *t = NULL;
    struct trainer_step_stats st;
    struct trainer_summary sum;
    snprintf(swap, sizeof(swap), "%s/swap", dir);
    snprintf(cfg, sizeof(cfg), "%s/c.json", dir);
    write_config(cfg, "nvme", "nvme", swap, "600K", "1M");
    struct trainer_opts o = small_model(cfg);
    o.model.L = 2;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    trainer_get_summary(t, &sum);
    cr_assert_eq(sum.checkpoints, 1, "a new run is checkpointed at step 0");
    cr_assert_eq(sum.checkpoint_step, 0);
    cr_assert_eq(trainer_step(t, &st), 0);
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_get_summary(t, &sum);
    uint64_t full = sum.checkpoint_bytes;
    cr_assert_eq(sum.checkpoint_step, 1);
    cr_assert_geq(full, sum.param_count * sizeof(float), "a step changes every parameter");
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_get_summary(t, &sum);
    cr_assert_eq(sum.checkpoints, 3);
    cr_assert_leq(sum.checkpoint_bytes, 4096,
                  "nothing changed but the step count's page: %llu "
                  "bytes (a full checkpoint wrote %llu)",
                  (unsigned long long)sum.checkpoint_bytes, (unsigned long long)full);
    cr_assert_geq(sum.checkpoint_seconds, 0);
    trainer_close(t);
}

/* ---- budgets: every one runs all its steps or is refused before step 1 ------------------- */

#define GRID_STEPS 3

/* Open with these budgets and run `steps` steps. Returns 0 when every step ran, or the
 * refusal of trainer_open (err says why); a step that fails is a test failure. */
static int grid_steps(const char *tag, int L, int C, enum trainer_precision prec, const char *dev,
                      const char *host, int steps, char *err, size_t errlen,
                      struct trainer_summary *sum)
{
    char cfg[4096], swap[4096];
    struct trainer *t = NULL;
    snprintf(swap, sizeof(swap), "%s/%s", dir, tag);
    snprintf(cfg, sizeof(cfg), "%s/%s.json", dir, tag);
    write_config(cfg, "nvme", "nvme", swap, dev, host);
    struct trainer_opts o = small_model(cfg);
    o.model.L = L;
    o.model.C = C;
    o.precision = prec;
    o.steps = GRID_STEPS;
    int r = trainer_open(&o, &t, err, errlen);
    if (r < 0) {
        cr_assert_null(t);
        test_rmtree(strdup(swap)); /* it frees what it is given */
        return r;
    }
    for (int s = 1; s <= steps; s++) {
        struct trainer_step_stats st;
        r = trainer_step(t, &st);
        cr_assert_eq(r, 0,
                     "%dx%d %s, device %s, host %s: the budgets were taken at open but "
                     "step %d failed: %s",
                     L, C, prec == TRAINER_PRECISION_BF16 ? "bf16" : "fp32", dev, host, s,
                     zinf_strerror(r));
        cr_assert(isfinite(st.loss));
    }
    if (sum) trainer_get_summary(t, sum);
    trainer_close(t);
    test_rmtree(strdup(swap));
    return 0;
}

static int grid_point(const char *tag, int L, int C, enum trainer_precision prec, const char *dev,
                      const char *host, char *err, size_t errlen)
{
    return grid_steps(tag, L, C, prec, dev, host, GRID_STEPS, err, errlen, NULL);
}

/* The refusal names both smallest budgets as the numbers the config takes. */
static void expect_refusal_names(const char *err, uint64_t dev, uint64_t host)
{
    char want[128];
    snprintf(want, sizeof(want), "\"device_bytes\": %llu, \"host_bytes\": %llu",
             (unsigned long long)dev, (unsigned long long)host);
    cr_assert(strstr(err, want), "the refusal should name %s: %s", want, err);
}

/* On a grid of device and host budgets around what two shapes need (where the tiers used
 * to fragment: a point passed the check at open, then failed at step 1 or 2 with -ENOMEM),
 * each point runs all its steps or is refused at open; the smallest budgets the trainer
 * computes run, and 4 KiB less of either is refused, naming them. bf16 too (mixed
 * precision, the default on a GPU). Without test_soak() each shape runs every other point
 * of the grid (a checkerboard, the two shapes on opposite squares); the boundaries all.
 * Under the sanitizers (test_sanitized()) only the checkerboard's points on the middle host
 * budget: 6x128 runs at 2M and 3M of device memory (2M is the one nearest its least),
 * 3x192 is refused at 1536K and 2560K and runs at 4M (the one nearest its least); the normal
 * build runs the other 10. The least budgets a shape needs are set at open (the check
 * refuses with them), so the roomy run that asks for them runs no step. */
Test(train, every_budget_runs_all_its_steps_or_is_refused_before_step_one)
{
    static const int shapes[2][2] = {{6, 128}, {3, 192}};
    static const char *const devs[] = {"1536K", "2M", "2560K", "3M", "4M"};
    static const char *const hosts[] = {"2M", "4M", "8M"};
    char err[1024], dev[32], host[32];
    int ran = 0, refused = 0;

    for (int s = 0; s < 2; s++) {
        int L = shapes[s][0], C = shapes[s][1];
        for (int p = 0; p < 2; p++) {
            enum trainer_precision prec = p ? TRAINER_PRECISION_BF16 : TRAINER_PRECISION_FP32;
            struct trainer_summary sum;
            /* What the trainer says it needs, opened with room to spare. */
            cr_assert_eq(grid_steps("roomy", L, C, prec, "64M", "64M", 0, err, sizeof(err), &sum),
                         0, "%s", err);
            uint64_t md = sum.min_budget[0], mh = sum.min_budget[1];
            cr_assert_gt(md, 0);
            cr_assert_gt(mh, 0);
            cr_assert_eq(md % 4096, 0);
            snprintf(dev, sizeof(dev), "%llu", (unsigned long long)md);
            snprintf(host, sizeof(host), "%llu", (unsigned long long)mh);
            cr_assert_eq(grid_point("least", L, C, prec, dev, host, err, sizeof(err)), 0,
                         "%dx%d at the least budgets it names: %s", L, C, err);
            snprintf(dev, sizeof(dev), "%llu", (unsigned long long)md - 4096);
            cr_assert_eq(grid_point("dev-4K", L, C, prec, dev, host, err, sizeof(err)),
                         -EINVAL);
            cr_assert(strstr(err, "zinf.device_bytes") && !strstr(err, "zinf.host_bytes"), "%s",
                      err);
            expect_refusal_names(err, md, mh);
            snprintf(dev, sizeof(dev), "%llu", (unsigned long long)md);
            snprintf(host, sizeof(host), "%llu", (unsigned long long)mh - 4096);
            cr_assert_eq(grid_point("host-4K", L, C, prec, dev, host, err, sizeof(err)),
                         -EINVAL);
            cr_assert(strstr(err, "zinf.host_bytes") && !strstr(err, "zinf.device_bytes"), "%s",
                      err);
            expect_refusal_names(err, md, mh);
            if (p) continue; /* the grid in fp32; bf16's boundary above */
            for (size_t d = 0; d < sizeof(devs) / sizeof(devs[0]); d++)
                for (size_t h = 0; h < sizeof(hosts) / sizeof(hosts[0]); h++) {
                    if (!test_soak() && (d + h + (size_t)s) % 2) continue;
                    if (test_sanitized() && h != 1) continue;
                    int r = grid_point("grid", L, C, prec, devs[d], hosts[h], err, sizeof(err));
                    if (r == 0) {
                        ran++;
                        continue;
                    }
                    cr_assert_eq(r, -EINVAL, "%s", err);
                    expect_refusal_names(err, md, mh);
                    refused++;
                }
        }
    }
    cr_assert_gt(ran, 0);
    cr_assert_gt(refused, 0);
}

/* ---- DeepSpeed's training keys ------------------------------------------------------------ */

/* The learning rate of each step as DeepSpeed's schedulers give it: these are the lr its
 * optimizer used at steps 1..14 (DeepSpeed 0.19.8, torch SGD underneath, scheduler.step()
 * after each optimizer step, as its engine does). */
Test(train, lr_schedules_are_deepspeeds)
{
    static const double warmup[14] = {0.0001,
                                      0.0001,
                                      0.00048760890226605375,
                                      0.00071434557503738687,
                                      0.00087521780453210757,
                                      0.001,
                                      0.001,
                                      0.001,
                                      0.001,
                                      0.001,
                                      0.001,
                                      0.001,
                                      0.001,
                                      0.001};
    static const double decay[14] = {0,        0,        0.00025,  0.0005,   0.00075,
                                     0.001,    0.000875, 0.00075,  0.000625, 0.0005,
                                     0.000375, 0.00025,  0.000125, 0};
    static const double cosine[14] = {0,
                                      0.0002,
                                      0.0011,
                                      0.0016264662506490406,
                                      0.002,
                                      0.0019246407371861739,
                                      0.001710035713374682,
                                      0.001388856598041439,
                                      0.00101,
                                      0.00063114340195856119,
                                      0.00030996428662531807,
                                      9.5359262813826128e-05,
                                      2e-05,
                                      2e-05};
    struct trainer_lr_schedule w = {
        .type = TRAINER_SCHED_WARMUP, .min_lr = 0.0001, .max_lr = 0.001, .warmup_steps = 5};
    struct trainer_lr_schedule d = {.type = TRAINER_SCHED_WARMUP_DECAY,
                                    .min_lr = 0,
                                    .max_lr = 0.001,
                                    .warmup_steps = 4,
                                    .total_steps = 12,
                                    .linear = true};
    struct trainer_lr_schedule c = {.type = TRAINER_SCHED_WARMUP_COSINE,
                                    .min_ratio = 0.1,
                                    .cos_min_ratio = 0.01,
                                    .warmup_steps = 4,
                                    .total_steps = 12};
    struct trainer_lr_schedule k = {.type = TRAINER_SCHED_CONSTANT};
    for (int s = 1; s <= 14; s++) {
        cr_expect(fabs(trainer_lr_at(&w, 0.002, s) - warmup[s - 1]) <= 1e-15,
                  "WarmupLR step %d: "
                  "%.17g, DeepSpeed %.17g",
                  s, trainer_lr_at(&w, 0.002, s), warmup[s - 1]);
        cr_expect(fabs(trainer_lr_at(&d, 0.002, s) - decay[s - 1]) <= 1e-15,
                  "WarmupDecayLR step "
                  "%d: %.17g, DeepSpeed %.17g",
                  s, trainer_lr_at(&d, 0.002, s), decay[s - 1]);
        cr_expect(fabs(trainer_lr_at(&c, 0.002, s) - cosine[s - 1]) <= 1e-15,
                  "WarmupCosineLR "
                  "step %d: %.17g, DeepSpeed %.17g",
                  s, trainer_lr_at(&c, 0.002, s), cosine[s - 1]);
        cr_expect_eq(trainer_lr_at(&k, 0.002, s), 0.002);
    }
}

/* A config without budgets: zinf train derives them from the RAM available and the run, and
 * they run every shape and placement (each at least the least that runs), sized to the run
 * (a few MiB model gets tens of MiB, not the engine's 1 GiB), and say how. Given budgets
 * are kept as given. */
Test(train, derived_budgets_run_every_shape_and_fit_the_run)
{
    static const struct {
        int L, C, NH, T, B, accum;
        enum trainer_precision prec;
        const char *param, *opt;
    } runs[] = {
        {1, 16, 2, 8, 1, 1, TRAINER_PRECISION_FP32, "none", "none"},
        {2, 64, 4, 32, 4, 2, TRAINER_PRECISION_BF16, "cpu", "cpu"},
        {3, 96, 3, 48, 2, 1, TRAINER_PRECISION_FP16, "nvme", "nvme"},
        {2, 128, 8, 64, 8, 3, TRAINER_PRECISION_FP32, "none", "nvme"},
        {1, 256, 4, 16, 1, 1, TRAINER_PRECISION_BF16, "cpu", "none"},
    };
    for (size_t i = 0; i < ARRAY_SIZE(runs); i++) {
        char cfg[4096], swap[4096];
        snprintf(cfg, sizeof(cfg), "%s/derived%zu.json", dir, i);
        snprintf(swap, sizeof(swap), "%s/derived%zu", dir, i);
        FILE *f = fopen(cfg, "w");
        cr_assert_not_null(f);
        fprintf(f,
                "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"%s\", "
                "\"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"%s\", "
                "\"nvme_path\": \"%s\"}}}",
                runs[i].param, swap, runs[i].opt, swap);
        fclose(f);
        struct trainer_opts o = small_model(cfg);
        o.model.L = runs[i].L;
        o.model.C = runs[i].C;
        o.model.NH = runs[i].NH;
        o.seq = runs[i].T;
        o.batch = runs[i].B;
        o.grad_accum = runs[i].accum;
        o.precision = runs[i].prec;
        o.steps = 1;
        float loss[1];
        struct trainer_summary sum;
        run_steps(&o, 1, loss, &sum);
        cr_expect_geq(sum.tier[0].budget_bytes, sum.min_budget[0], "run %zu: device", i);
        cr_expect_geq(sum.tier[1].budget_bytes, sum.min_budget[1], "run %zu: host", i);
        cr_expect_eq(sum.tier[0].budget_bytes, sum.budgets.device, "run %zu", i);
        cr_expect_eq(sum.tier[1].budget_bytes, sum.budgets.host, "run %zu", i);
        /* Sized to the run: its state and a quarter more, plus 16 MiB. */
        uint64_t most = sum.budgets.state_bytes + sum.budgets.state_bytes / 4 + 16 * MiB;
        cr_expect_leq(sum.budgets.device, align_up(most, ZINF_ALIGN), "run %zu", i);
        cr_expect_geq(sum.budgets.state_bytes, sum.model_state_bytes, "run %zu", i);
        cr_expect(strstr(sum.budgets.device_how, "a quarter of the") &&
                      strstr(sum.budgets.host_how, "half of the"),
                  "run %zu: %s / %s", i, sum.budgets.device_how, sum.budgets.host_how);
    }
    /* Given budgets stay as given, and nothing is said of them. */
    char cfg[4096];
    struct trainer_opts o = nvme_model(cfg, sizeof(cfg), "given", "8M", "3M");
    o.steps = 1;
    float loss[1];
    struct trainer_summary sum;
    run_steps(&o, 1, loss, &sum);
    cr_expect_eq(sum.tier[0].budget_bytes, 8 * MiB);
    cr_expect_eq(sum.tier[1].budget_bytes, 3 * MiB);
    cr_expect(!sum.budgets.device_how[0] && !sum.budgets.host_how[0]);
}

/* LAMB and Adam's L2 where the optimizer's states are homed on the device (the backend's
 * kernels) and on NVMe (the host's): the same update, so bitwise the same losses. */
Test(train, lamb_and_adam_l2_on_the_device_equal_them_on_the_host)
{
    static const enum trainer_optimizer which[] = {TRAINER_OPT_LAMB, TRAINER_OPT_ADAM_L2};
    for (int k = 0; k < 2; k++) {
        float dev[STEPS], host[STEPS];
        char cfg[4096], swap[4096];
        snprintf(cfg, sizeof(cfg), "%s/optdev%d.json", dir, k);
        write_config(cfg, "none", "none", NULL, "64M", "16M");
        struct trainer_opts o = small_model(cfg);
        o.optimizer = which[k];
        o.weight_decay = 0.05f;
        o.lamb_max_coeff = 0.5f;
        run_steps(&o, STEPS, dev, NULL);
        snprintf(swap, sizeof(swap), "optnvme%d", k);
        o = nvme_model(cfg, sizeof(cfg), swap, "8M", "4M");
        o.optimizer = which[k];
        o.weight_decay = 0.05f;
        o.lamb_max_coeff = 0.5f;
        run_steps(&o, STEPS, host, NULL);
        expect_bitwise(dev, host, k ? "Adam L2, device vs host" : "LAMB, device vs host");
    }
}

/* A new run's weights from a source (zinf train --init) that fails half-way: trainer_open
 * answers the source's error, and nothing of the run is saved (a resume finds no run, a new
 * one starts without --overwrite). */
static int failing_source(void *ctx, int idx, float *dst)
{
    int *calls = ctx;
    (*calls)++;
    if (idx == 5) return -EIO;
    memset(dst, 0, 4); /* the first element; the rest as the buffer held it */
    return 0;
}

Test(train, init_source_failing_half_way_saves_nothing)
{
    char cfg[4096];
    struct trainer_opts o = nvme_model(cfg, sizeof(cfg), "initfail", "8M", "4M");
    int calls = 0;
    o.init_source = failing_source;
    o.init_ctx = &calls;
    struct trainer *t = NULL;
    char err[512];
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EIO, "%s", err);
    cr_assert_null(t);
    cr_expect_eq(calls, 6);
    cr_expect(strstr(err, "initialising the parameters failed"), "%s", err);
    o.init_source = NULL;
    o.resume = true;
    cr_expect_lt(trainer_open(&o, &t, err, sizeof(err)), 0, "a half-initialised run was saved");
    cr_assert_null(t);
    o.resume = false;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    trainer_close(t);
}

/* OneCycle, against DeepSpeed's OneCycle stepped as its engine steps it (0.19.8): the lr up
 * and down the cycle and decaying after it, beta1 the other way (from cycle_min_mom at step 1,
 * as its constructor sets it) and beta2 0.99; the staircase's flat runs; and without
 * cycle_momentum the optimizer's own betas. Equal as doubles. */
Test(train, one_cycle_is_deepspeeds)
{
    static const double lr1[10] = {0.001, 0.003250000000000001, 0.0055, 0.007750000000000001,
                                    0.009999999999999998, 0.005499999999999996, 0.001, 0.0008,
                                    0.0006666666666666666, 0.0005714285714285715};
    static const double mom1[10] = {0.8, 0.875, 0.8500000000000001, 0.8250000000000001, 0.8,
                                     0.8500000000000001, 0.9, 0.9450000000000001,
                                     0.9900000000000001, 1.035};
    static const double lr2[14] = {0.001, 0.001, 0.004, 0.004, 0.007, 0.007, 0.010000000000000002,
                                   0.007, 0.007, 0.004, 0.004, 0.001, 0.001, 0.001};
    static const double mom2[14] = {0.8, 0.9, 0.8666666666666667, 0.8666666666666667,
                                     0.8333333333333334, 0.8333333333333334, 0.8,
                                     0.8333333333333334, 0.8333333333333334, 0.8666666666666667,
                                     0.8666666666666667, 0.9, 0.9, 0.9};
    struct trainer_lr_schedule a = {.type = TRAINER_SCHED_ONE_CYCLE,
                                    .cycle_min_lr = 0.001,
                                    .cycle_max_lr = 0.01,
                                    .cycle_first_size = 4,
                                    .cycle_second_size = 2,
                                    .cycle_second_stairs = -1,
                                    .decay_step_size = 2,
                                    .decay_lr_rate = 0.5,
                                    .decay_mom_rate = 0.1,
                                    .cycle_momentum = true,
                                    .cycle_min_mom = 0.8,
                                    .cycle_max_mom = 0.9};
    struct trainer_lr_schedule b = a;
    b.cycle_first_size = 6;
    b.cycle_second_size = -1;
    b.cycle_first_stairs = 3;
    b.decay_step_size = 0;
    double b1, b2;
    for (int s = 1; s <= 14; s++) {
        if (s <= 10) {
            cr_expect_eq(trainer_lr_at(&a, 0.5, s), lr1[s - 1], "step %d: lr %.17g, DeepSpeed %.17g",
                         s, trainer_lr_at(&a, 0.5, s), lr1[s - 1]);
            trainer_betas_at(&a, 0.9, 0.999, s, &b1, &b2);
            cr_expect(b1 == mom1[s - 1] && b2 == 0.99, "step %d: betas %.17g %.17g, DeepSpeed %.17g",
                      s, b1, b2, mom1[s - 1]);
        }
        cr_expect_eq(trainer_lr_at(&b, 0.5, s), lr2[s - 1], "stairs, step %d: lr %.17g, DeepSpeed %.17g",
                     s, trainer_lr_at(&b, 0.5, s), lr2[s - 1]);
        trainer_betas_at(&b, 0.9, 0.999, s, &b1, &b2);
        cr_expect_eq(b1, mom2[s - 1], "stairs, step %d: beta1 %.17g, DeepSpeed %.17g", s, b1,
                     mom2[s - 1]);
    }
    b.cycle_momentum = false;
    trainer_betas_at(&b, 0.9, 0.999, 3, &b1, &b2);
    cr_expect(b1 == 0.9 && b2 == 0.999);
    /* A momentum decay that takes beta1 to 1 within the run is refused before it starts. */
    struct trainer_opts o;
    char err[512];
    trainer_opts_defaults(&o);
    o.sched = a;
    o.steps = 9;
    cr_expect_eq(trainer_opts_check(&o, err, sizeof(err)), 0, "%s", err);
    o.steps = 10;
    cr_expect_eq(trainer_opts_check(&o, err, sizeof(err)), -EINVAL);
    cr_expect(strstr(err, "momentum reaches 1.035 at step 10"), "%s", err);
    /* A cycle peaking at 1 is refused; cycle_min_mom at 1 is refused at step 1. */
    o.steps = 3;
    o.sched.cycle_max_mom = 1.0;
    cr_expect_eq(trainer_opts_check(&o, err, sizeof(err)), -EINVAL);
    cr_expect(strstr(err, "cycle_max_mom 1:"), "%s", err);
    o.sched.cycle_max_mom = 0.9;
    o.sched.cycle_min_mom = 1.0;
    cr_expect_eq(trainer_opts_check(&o, err, sizeof(err)), -EINVAL);
    cr_expect(strstr(err, "momentum reaches 1 at step 1"), "%s", err);
}

/* Two micro-batches of 2 sequences accumulated are one batch of 4: the same sequences (micro
 * m of step s draws what sequences 2m, 2m + 1 of the batch of 4 would), the mean of the
 * gradients, the same clipping; the losses agree to rounding. A run with accumulation resumes
 * bitwise, and a resume that changes it is refused. */
Test(train, gradient_accumulation_equals_the_larger_batch)
{
    char cfg[4096], err[512];
    float big[STEPS], acc[STEPS], resumed[STEPS];

    struct trainer_opts o = nvme_model(cfg, sizeof(cfg), "a", "1M", "1M");
    o.batch = 4;
    o.grad_clip = 0.5f; /* so that clipping acts on the accumulated norm too */
    run_steps(&o, STEPS, big, NULL);

    o = nvme_model(cfg, sizeof(cfg), "b", "1M", "1M");
    o.batch = 2;
    o.grad_accum = 2;
    o.grad_clip = 0.5f;
    run_steps(&o, STEPS, acc, NULL);
    for (int i = 0; i < STEPS; i++)
        cr_expect(fabsf(acc[i] - big[i]) <= 2e-5f * fabsf(big[i]),
                  "step %d: batch 4 %.9g, 2 x 2 accumulated %.9g", i + 1, big[i], acc[i]);

    /* Interrupted after 3 steps and resumed: bitwise the same. */
    o = nvme_model(cfg, sizeof(cfg), "c", "1M", "1M");
    o.batch = 2;
    o.grad_accum = 2;
    o.grad_clip = 0.5f;
    run_interrupted(&o, 3, resumed);
    expect_bitwise(resumed, acc, "resumed against uninterrupted");
    o.grad_accum = 3;
    struct trainer *t = NULL;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "--accumulate 2"), "%s", err);
}

/* Whole runs over a sweep of shapes (odd B*T, dims 32 to 160, 1 to 8 micro-batches), in
 * memory and with the state on NVMe: 1, 2 and 3 OpenMP threads log the same loss and the same
 * parameter digest at every step. */
Test(train, runs_give_the_same_bits_for_any_thread_count, .timeout = 300)
{
    const struct {
        int C, NH, seq, batch, accum;
        const char *home;
    } runs[] = {
        {64, 4, 32, 2, 1, "none"}, {32, 4, 13, 3, 2, "nvme"}, {96, 4, 23, 4, 1, "none"},
        {80, 10, 31, 5, 3, "none"}, {160, 4, 61, 8, 1, "none"}, {48, 2, 17, 3, 8, "nvme"},
        {128, 4, 100, 1, 2, "none"},
    };
    char cfg[4096], swap[4096], err[512];
    for (size_t k = 0; k < sizeof(runs) / sizeof(runs[0]); k++) {
        float loss[3][2];
        uint64_t dg[3][2];
        for (int th = 1; th <= 3; th++) {
            snprintf(swap, sizeof(swap), "%s/th%zu-%d", dir, k, th);
            snprintf(cfg, sizeof(cfg), "%s/th%zu-%d.json", dir, k, th);
            write_config(cfg, runs[k].home, runs[k].home, swap, "64M", "64M");
            struct trainer_opts o = small_model(cfg);
            o.model.L = 2;
            o.model.C = runs[k].C;
            o.model.NH = runs[k].NH;
            o.seq = runs[k].seq;
            o.batch = runs[k].batch;
            o.grad_accum = runs[k].accum;
            o.steps = 2;
            o.digest = true;
            omp_set_num_threads(th);
            struct trainer *t = NULL;
            cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
            for (int s = 0; s < 2; s++) {
                struct trainer_step_stats st;
                cr_assert_eq(trainer_step(t, &st), 0);
                step_digest(&st, s + 1, dg[th - 1]);
                loss[th - 1][s] = st.loss;
            }
            last_digest(t, 2, dg[th - 1]);
            trainer_close(t);
        }
        for (int th = 2; th <= 3; th++)
            for (int s = 0; s < 2; s++) {
                cr_expect(!memcmp(&loss[0][s], &loss[th - 1][s], sizeof(float)),
                          "run %zu (C %d, seq %d x %d x %d), step %d: loss %.9g at 1 thread, "
                          "%.9g at %d", k, runs[k].C, runs[k].seq, runs[k].batch, runs[k].accum,
                          s + 1, loss[0][s], loss[th - 1][s], th);
                cr_expect_eq(dg[0][s], dg[th - 1][s],
                             "run %zu (C %d, seq %d x %d x %d), step %d: digest %016llx at 1 "
                             "thread, %016llx at %d", k, runs[k].C, runs[k].seq, runs[k].batch,
                             runs[k].accum, s + 1, (unsigned long long)dg[0][s],
                             (unsigned long long)dg[th - 1][s], th);
            }
    }
    omp_set_num_threads(omp_get_num_procs());
}

/* ---- validation and sampling -------------------------------------------------------------- */

/* Validation and sampling between steps change nothing a step depends on: the losses are
 * bitwise those of a run without them. The validation loss is the same when asked twice,
 * a sample with the same seed the same bytes; both are refused where they cannot work. */
Test(train, eval_and_sample_leave_the_training_exactly_as_it_was)
{
    char cfg[4096], err[512];
    float ref[STEPS], got[STEPS];
    struct trainer *t = NULL;
    struct trainer_step_stats st;

    struct trainer_opts o = nvme_model(cfg, sizeof(cfg), "ref", "1M", "2M");
    o.sample = true;
    run_steps(&o, STEPS, ref, NULL);

    o = nvme_model(cfg, sizeof(cfg), "ev", "1M", "2M");
    o.sample = true;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    unsigned char a[16], b[16];
    for (int s = 0; s < STEPS; s++) {
        float v1, v2;
        cr_assert_eq(trainer_eval(t, 3, &v1), 0);
        cr_assert_eq(trainer_eval(t, 3, &v2), 0);
        cr_assert(isfinite(v1) && v1 > 0, "%g", v1);
        cr_assert(memcmp(&v1, &v2, sizeof(v1)) == 0, "the same tail twice: %.9g, %.9g", v1, v2);
        cr_assert_eq(trainer_sample(t, 42, (const unsigned char *)"\n", 1, a, sizeof(a)), 16);
        cr_assert_eq(trainer_sample(t, 42, (const unsigned char *)"\n", 1, b, sizeof(b)), 16);
        cr_assert_eq(memcmp(a, b, sizeof(a)), 0, "the same seed, the same bytes");
        cr_assert_eq(trainer_step(t, &st), 0);
        got[s] = st.loss;
    }
    /* The context is one sequence (32 bytes here): a prompt and what follows fit in it. */
    unsigned char big[64];
    cr_assert_eq(trainer_sample(t, 1, (const unsigned char *)"\n", 1, big, 32), -EINVAL);
    cr_assert_eq(trainer_sample(t, 1, (const unsigned char *)"\n", 0, big, 8), -EINVAL);
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_close(t);
    expect_bitwise(got, ref, "with validation and sampling against without");

    /* Sampling was not announced (its host-tier set was not in the budget check). */
    o = nvme_model(cfg, sizeof(cfg), "ns", "1M", "2M");
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_sample(t, 1, (const unsigned char *)"\n", 1, big, 8), -EINVAL);
    trainer_close(t);

    /* Data too short to hold a tail out: nothing to validate on. */
    char shortdata[4096];
    snprintf(shortdata, sizeof(shortdata), "%s/short.txt", dir);
    FILE *f = fopen(shortdata, "w");
    for (int i = 0; i < 100; i++)
        fputc('a' + i % 26, f);
    fclose(f);
    o = nvme_model(cfg, sizeof(cfg), "sh", "1M", "2M");
    o.data_path = shortdata;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    float v;
    cr_assert_eq(trainer_eval(t, 1, &v), -ENODATA);
    cr_assert_eq(trainer_step(t, &st), 0, "the trainer goes on");
    trainer_close(t);
}

/* stage3_param_persistence_threshold acts: the weights of fewer elements are homed on the
 * device (DeepSpeed's persistent parameters), which the least device budget counts; the
 * losses are bitwise those of the run without it; a resume under another threshold is
 * refused, naming it. */
Test(train, small_weights_persist_on_the_device_below_the_threshold)
{
    char cfg[4096], swap[4096], err[512];
    float ref[STEPS], got[STEPS];
    struct trainer_summary s0, s1;

    struct trainer_opts o = nvme_model(cfg, sizeof(cfg), "plain", "1M", "2M");
    run_steps(&o, STEPS, ref, &s0);

    snprintf(swap, sizeof(swap), "%s/persist", dir);
    snprintf(cfg, sizeof(cfg), "%s/persist.json", dir);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    /* dim 64: the biases and norms (64 to 256 elements) persist, the matrices do not. */
    fprintf(f,
            "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}, \"stage3_param_persistence_threshold\": 1000}, "
            "\"aio\": {\"block_size\": 65536, \"queue_depth\": 8}, \"zinf\": {\"device\": "
            "\"emulated\", \"device_bytes\": \"1M\", \"host_bytes\": \"2M\"}}",
            swap, swap);
    fclose(f);
    o = small_model(cfg);
    o.steps = 3;
    run_steps(&o, 3, got, &s1);
    cr_assert_gt(s1.min_budget[0], s0.min_budget[0], "the persistent weights are device homes");
    struct trainer *t = NULL;
    o.steps = STEPS;
    o.resume = true;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    /* Every small weight is homed on the device, every matrix on NVMe. */
    zinf_engine *e = trainer_engine(t);
    int small = 0;
    for (int k = 0; k < 2; k++) {
        zinf_tensor h;
        const char *name = k ? "p.h0.attn.qkv.w" : "p.h0.ln1.w";
        cr_assert_eq(zinf_lookup(e, name, &h), 0, "%s", name);
        pthread_mutex_lock(&e->lock);
        enum zinf_tier home = engine_tensor(e, h)->home;
        pthread_mutex_unlock(&e->lock);
        cr_expect_eq(home, k ? ZINF_TIER_NVME : ZINF_TIER_DEVICE, "%s", name);
        small += home == ZINF_TIER_DEVICE;
    }
    cr_assert_eq(small, 1);
    for (int i = 3; i < STEPS; i++) {
        struct trainer_step_stats st;
        cr_assert_eq(trainer_step(t, &st), 0);
        got[i] = st.loss;
    }
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_close(t);
    expect_bitwise(got, ref, "with persistent weights against without");

    /* The saved run under another threshold: refused, naming the key. */
    f = fopen(cfg, "w");
    fprintf(f,
            "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}, \"offload_optimizer\": {\"device\": \"nvme\", "
            "\"nvme_path\": \"%s\"}}, \"aio\": {\"block_size\": 65536, \"queue_depth\": 8}, "
            "\"zinf\": {\"device\": \"emulated\", \"device_bytes\": \"1M\", \"host_bytes\": "
            "\"2M\"}}",
            swap, swap);
    fclose(f);
    o.steps = STEPS + 1;
    t = NULL;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "stage3_param_persistence_threshold"), "%s", err);
    cr_assert_null(t);
}

/* ---- fp16 and DeepSpeed's loss scaling ---------------------------------------------------- */

/* The scale after each of 40 steps whose gradients overflowed where pattern says, as
 * DeepSpeed 0.19.8's DynamicLossScaler gave them (init 2^5, window 4, hysteresis 2, min 2),
 * without and with consecutive_hysteresis. */
Test(train, loss_scaler_is_deepspeeds)
{
    static const int pattern[40] = {0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0,
                                    0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0};
    static const double plain[40] = {32, 32, 32, 32, 32, 32, 32, 64, 64,  32,  32,  16, 16, 16,
                                     16, 16, 32, 32, 32, 32, 64, 64, 32,  16,  16,  16, 16, 16,
                                     32, 32, 32, 32, 64, 64, 64, 64, 128, 128, 128, 128};
    static const double cons[40] = {32, 32, 32, 32, 32,  32,  32,  64,  64,  32,  32,  32, 32, 32,
                                    32, 32, 64, 64, 64,  64,  128, 128, 64,  32,  32,  32, 32, 32,
                                    64, 64, 64, 64, 128, 128, 128, 128, 256, 256, 256, 256};
    for (int c = 0; c < 2; c++) {
        struct loss_scale s;
        loss_scale_init(&s, 0, 5, 4, 2, 2.0, c == 1);
        int skipped = 0;
        for (int i = 0; i < 40; i++) {
            loss_scale_update(&s, pattern[i]);
            skipped += pattern[i];
            cr_expect_eq(s.scale, c ? cons[i] : plain[i], "%s, after step %d: %g, DeepSpeed %g",
                         c ? "consecutive hysteresis" : "hysteresis", i + 1, s.scale,
                         c ? cons[i] : plain[i]);
        }
        cr_expect_eq(s.skipped, skipped);
    }
    /* A static scale never moves; its overflows are skipped all the same. */
    struct loss_scale s;
    loss_scale_init(&s, 128, 16, 1000, 2, 1, false);
    loss_scale_update(&s, true);
    loss_scale_update(&s, false);
    cr_expect_eq(s.scale, 128);
    cr_expect_eq(s.skipped, 1);
}

static struct trainer_opts fp16_model(char *cfg, size_t n, const char *tag)
{
    struct trainer_opts o = nvme_model(cfg, n, tag, "1M", "2M");
    o.precision = TRAINER_PRECISION_FP16;
    o.fp16.loss_scale_window = 3;
    return o;
}

/* fp16 weights on the CPU backend with dynamic loss scaling: the losses follow fp32's to
 * fp16 rounding; a step whose gradients overflow changes no parameter and lowers the scale
 * as DeepSpeed does (after the hysteresis); the scaler resumes where it was, so a resumed
 * run is bitwise an uninterrupted one. */
Test(train, fp16_with_loss_scaling)
{
    char cfg[4096], err[512];
    float f32[STEPS], f16[STEPS], resumed[STEPS];
    struct trainer_summary sum;

    struct trainer_opts o = nvme_model(cfg, sizeof(cfg), "f32", "1M", "2M");
    run_steps(&o, STEPS, f32, NULL);
    o = fp16_model(cfg, sizeof(cfg), "f16");
    run_steps(&o, STEPS, f16, &sum);
    cr_assert_str_eq(sum.precision, "fp16");
    for (int i = 0; i < STEPS; i++)
        cr_expect(fabsf(f16[i] - f32[i]) <= 2e-2f * fabsf(f32[i]), "step %d: fp32 %.9g, fp16 %.9g",
                  i + 1, f32[i], f16[i]);
    /* 2^16, doubled once: DeepSpeed doubles when 3 (the window) steps since the last overflow
     * went by, here at the 4th of 6. */
    cr_expect_eq(sum.loss_scale, 65536.0 * 2, "%g", sum.loss_scale);
    cr_expect_eq(sum.skipped_steps, 0);

    /* Interrupted after 3 steps, resumed: bitwise. */
    o = fp16_model(cfg, sizeof(cfg), "f16r");
    run_interrupted(&o, 3, resumed);
    expect_bitwise(resumed, f16, "resumed against uninterrupted");

    /* Overflows: the first is absorbed by the hysteresis, the second halves the scale; no
     * parameter moves in either. */
    o = fp16_model(cfg, sizeof(cfg), "ovf");
    o.digest = true;
    struct trainer *t = NULL;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    zinf_tensor wte;
    cr_assert_eq(zinf_lookup(trainer_engine(t), "p.wte", &wte), 0);
    size_t nb = (size_t)o.model.V * o.model.C * sizeof(float);
    unsigned char *before = malloc(nb), *after = malloc(nb);
    struct trainer_step_stats st;
    cr_assert_eq(trainer_step(t, &st), 0);
    cr_assert_not(st.skipped);
    cr_assert(st.have_digest);
    uint64_t digest = st.digest;
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(zinf_read(trainer_engine(t), wte, 0, before, nb), 0);
        trainer_fault_overflow(t);
        cr_assert_eq(trainer_step(t, &st), 0);
        cr_assert(st.skipped, "overflow %d", k + 1);
        /* Nothing moved: the digest is the last step's, the norm not finite. */
        cr_assert(st.have_digest && st.digest == digest, "overflow %d: digest", k + 1);
        cr_assert_not(isfinite(st.grad_norm));
        cr_assert_eq(zinf_read(trainer_engine(t), wte, 0, after, nb), 0);
        cr_assert_eq(memcmp(before, after, nb), 0, "a skipped step changed the parameters");
        trainer_get_summary(t, &sum);
        cr_expect_eq(sum.loss_scale, k ? 32768.0 : 65536.0, "after overflow %d: %g", k + 1,
                     sum.loss_scale);
    }
    cr_expect_eq(sum.skipped_steps, 2);
    cr_assert_eq(trainer_step(t, &st), 0);
    cr_assert_not(st.skipped);
    cr_assert(isfinite(st.loss));
    cr_assert(st.have_digest && st.digest != digest, "an applied step moves the digest");
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_close(t);
    free(before);
    free(after);
}

/* The digest of every fp32 parameter, read back through the engine, tensor by tensor in
 * the layout's order: what trainer_step_stats.digest must be. */
static uint64_t digest_of_params(struct trainer *t, const struct trainer_opts *o)
{
    struct gpt_config gc = o->model;
    gc.maxT = o->seq;
    int n = gpt_layout(&gc, NULL, 0);
    cr_assert_gt(n, 0);
    struct gpt_tensor_desc *d = calloc((size_t)n, sizeof(*d));
    cr_assert_eq(gpt_layout(&gc, d, (size_t)n), n);
    zinf_engine *e = trainer_engine(t);
    uint64_t sum = 0;
    for (int i = 0; i < n; i++) {
        char name[96];
        zinf_tensor h;
        snprintf(name, sizeof(name), "p.%s", d[i].name);
        cr_assert_eq(zinf_lookup(e, name, &h), 0, "%s", name);
        float *p = malloc(d[i].numel * sizeof(float));
        cr_assert_eq(zinf_read(e, h, 0, p, d[i].numel * sizeof(float)), 0);
        sum += digest_floats(p, d[i].numel, (uint32_t)i, 0);
        free(p);
    }
    free(d);
    return sum;
}

/* With lr 0 a step leaves the parameters as they were, so its digest is theirs: two runs
 * that differ by one bit of one weight (flipped through the engine before step 1) log
 * different digests, and each is the digest of the parameters read back. The same run
 * twice logs the same digest; with the digest off, none is given. */
Test(train, digest_tells_apart_one_bit_in_one_weight)
{
    char cfg[4096], swap[4096], err[512];
    uint64_t got[3];
    for (int k = 0; k < 3; k++) {
        struct trainer *t = NULL;
        struct trainer_step_stats st;
        snprintf(swap, sizeof(swap), "%s/dg%d", dir, k);
        snprintf(cfg, sizeof(cfg), "%s/dg%d.json", dir, k);
        write_config(cfg, "nvme", "nvme", swap, "64M", "64M");
        struct trainer_opts o = small_model(cfg);
        o.lr = 0;
        o.digest = true;
        cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
        if (k == 2) {
            /* One bit of one weight, in the middle of the first block's qkv matrix. */
            zinf_tensor h;
            float w;
            size_t at = 1000 * sizeof(float);
            cr_assert_eq(zinf_lookup(trainer_engine(t), "p.h0.attn.qkv.w", &h), 0);
            cr_assert_eq(zinf_read(trainer_engine(t), h, at, &w, sizeof(w)), 0);
            uint32_t u;
            memcpy(&u, &w, sizeof(u));
            u ^= 1u << 3;
            memcpy(&w, &u, sizeof(w));
            cr_assert_eq(zinf_write(trainer_engine(t), h, at, &w, sizeof(w)), 0);
        }
        cr_assert_eq(trainer_step(t, &st), 0);
        step_digest(&st, 1, got + k);
        if (st.update_pending) last_digest(t, 1, got + k);
        cr_assert_eq(got[k], digest_of_params(t, &o), "run %d: the step's digest is not that of "
                     "its parameters", k);
        cr_assert_eq(st.lr, 0.0f);
        trainer_close(t);
    }
    cr_expect_eq(got[0], got[1], "the same run twice: %016llx, %016llx",
                 (unsigned long long)got[0], (unsigned long long)got[1]);
    cr_expect_neq(got[0], got[2], "one bit flipped, the same digest %016llx",
                  (unsigned long long)got[0]);

    struct trainer *t = NULL;
    struct trainer_step_stats st;
    snprintf(swap, sizeof(swap), "%s/dgoff", dir);
    snprintf(cfg, sizeof(cfg), "%s/dgoff.json", dir);
    write_config(cfg, "none", "none", swap, "64M", "64M");
    struct trainer_opts o = small_model(cfg);
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_step(t, &st), 0);
    cr_expect_not(st.have_digest);
    trainer_close(t);
}

/* The step's norm, clip scale and learning rate are what the optimizer used: the norm is
 * that of the gradient (its square from the backend's sum), the clip scale min(1, clip /
 * norm), the rate the schedule's. */
Test(train, step_reports_norm_clip_and_lr)
{
    char cfg[4096], swap[4096], err[512];
    struct trainer *t = NULL;
    struct trainer_step_stats st;
    snprintf(swap, sizeof(swap), "%s/ncl", dir);
    snprintf(cfg, sizeof(cfg), "%s/ncl.json", dir);
    write_config(cfg, "none", "none", swap, "64M", "64M");
    struct trainer_opts o = small_model(cfg);
    o.grad_clip = 0.05f; /* below the first steps' norms: every step is clipped */
    o.sched = (struct trainer_lr_schedule){.type = TRAINER_SCHED_WARMUP, .min_lr = 0,
                                           .max_lr = 1e-3, .warmup_steps = 4, .linear = true};
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    for (int s = 1; s <= 3; s++) {
        cr_assert_eq(trainer_step(t, &st), 0);
        cr_assert(isfinite(st.grad_norm) && st.grad_norm > 0.05, "step %d: norm %g", s,
                  st.grad_norm);
        cr_expect_eq(st.clip_scale, (float)((double)0.05f / st.grad_norm), "step %d", s);
        cr_expect_eq(st.lr, (float)trainer_lr_at(&o.sched, o.lr, s), "step %d", s);
    }
    trainer_close(t);
}

/* trainer_plan (zinf tune's pruning) decides what trainer_open decides, with nothing opened:
 * the same smallest budgets for every placement, precision, accumulation, persistence and
 * sampling; the budgets the config gives; and the same refusals of bad options. For several
 * ranks (which cannot meet here) each rank's shard is smaller: the Adam states at stage 1,
 * the gradients too at 2, the parameters too at 3. */
Test(train, plan_gives_the_budgets_that_open_checks)
{
    static const struct {
        const char *param, *optim;
        enum trainer_precision prec;
        int accum;
        bool persist, sample;
    } cases[] = {
        {"nvme", "nvme", TRAINER_PRECISION_FP32, 1, false, false},
        {"cpu", "cpu", TRAINER_PRECISION_FP32, 2, false, false},
        {"none", "none", TRAINER_PRECISION_BF16, 1, false, true},
        {"none", "nvme", TRAINER_PRECISION_FP32, 3, false, false},
        {"cpu", "nvme", TRAINER_PRECISION_BF16, 2, true, false},
        {"nvme", "cpu", TRAINER_PRECISION_FP32, 1, true, true},
    };
    char cfg[4096], swap[4096], err[1024];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(swap, sizeof(swap), "%s/plan%zu", dir, i);
        snprintf(cfg, sizeof(cfg), "%s/plan%zu.json", dir, i);
        FILE *f = fopen(cfg, "w");
        cr_assert_not_null(f);
        fprintf(f,
                "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"%s\"},"
                " \"offload_optimizer\": {\"device\": \"%s\"}%s}, \"zinf\": {\"device\": "
                "\"emulated\", \"nvme_paths\": [\"%s\"], \"device_bytes\": \"64M\", "
                "\"host_bytes\": \"48M\"}}",
                cases[i].param, cases[i].optim,
                cases[i].persist ? ", \"stage3_param_persistence_threshold\": 1000" : "", swap);
        fclose(f);
        struct trainer_opts o = small_model(cfg);
        o.precision = cases[i].prec;
        o.grad_accum = cases[i].accum;
        o.sample = cases[i].sample;
        struct trainer_plan pl;
        cr_assert_eq(trainer_plan(&o, &pl, err, sizeof(err)), 0, "case %zu: %s", i, err);
        cr_expect_eq(pl.budget[0], 64 * MiB, "case %zu: the config's device budget", i);
        cr_expect_eq(pl.budget[1], 48 * MiB, "case %zu: the config's host budget", i);
        cr_expect_eq(pl.stage, 0);
        struct trainer *t = NULL;
        cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "case %zu: %s", i, err);
        struct trainer_summary sum;
        trainer_get_summary(t, &sum);
        trainer_close(t);
        cr_expect_eq(pl.min_budget[0], sum.min_budget[0], "case %zu: device %llu vs open's %llu",
                     i, (unsigned long long)pl.min_budget[0],
                     (unsigned long long)sum.min_budget[0]);
        cr_expect_eq(pl.min_budget[1], sum.min_budget[1], "case %zu: host %llu vs open's %llu", i,
                     (unsigned long long)pl.min_budget[1], (unsigned long long)sum.min_budget[1]);
        cr_expect_eq(pl.param_count, sum.param_count, "case %zu", i);
        test_rmtree(strdup(swap));

        /* Two ranks (they cannot meet here): planned all the same, at the stage asked, with
         * budgets derived where the config gives none; zinf tune runs them. */
        for (int stage = 1; stage <= 3; stage++) {
            FILE *g = fopen(cfg, "w");
            cr_assert_not_null(g);
            fprintf(g,
                    "{\"zero_optimization\": {\"stage\": %d, \"offload_param\": {\"device\": "
                    "\"%s\"}, \"offload_optimizer\": {\"device\": \"%s\"}}, \"zinf\": "
                    "{\"device\": \"emulated\", \"nvme_paths\": [\"%s\"]}}",
                    stage, cases[i].param, cases[i].optim, swap);
            fclose(g);
            o.world = 2;
            o.rank = 0;
            cr_assert_eq(trainer_plan(&o, &pl, err, sizeof(err)), 0, "case %zu stage %d: %s", i,
                         stage, err);
            cr_expect_eq(pl.stage, stage);
            cr_expect_gt(pl.min_budget[0], 0);
            cr_expect_gt(pl.budget[0], 0, "derived where the config gives none");
            cr_expect_gt(pl.budget[1], 0, "derived where the config gives none");
            o.world = 1;
        }
    }
    /* What open refuses of the options, plan refuses in the same words. */
    snprintf(cfg, sizeof(cfg), "%s/plan0.json", dir);
    struct trainer_opts o = small_model(cfg);
    o.model.NH = 5; /* 64 is not a multiple of 5 */
    struct trainer_plan pl;
    char err2[1024];
    struct trainer *t = NULL;
    cr_assert_eq(trainer_plan(&o, &pl, err, sizeof(err)), -EINVAL);
    cr_assert_eq(trainer_open(&o, &t, err2, sizeof(err2)), -EINVAL);
    cr_assert_str_eq(err, err2);
    snprintf(cfg, sizeof(cfg), "%s/no-such.json", dir);
    o = small_model(cfg);
    cr_assert_lt(trainer_plan(&o, &pl, err, sizeof(err)), 0);
    cr_assert(strstr(err, "no-such.json"), "%s", err);
}

/* zinf.train.checkpoint_start false (trainer_opts.no_start_checkpoint): a new run saves
 * nothing at open, so its swap space holds the state once, where a run that saved step 0
 * keeps that version beside the newest (copy on write) and grows to twice it. The bits are
 * the same, the close saves the run, and it resumes. A step failing halfway before any
 * checkpoint leaves nothing saved, and the next run starts afresh there. */
Test(train, no_start_checkpoint_holds_the_state_once)
{
    char cfg[4096], err[512];
    float ref[STEPS], got[STEPS];
    uint64_t opened[2], peak[2];
    for (int k = 0; k < 2; k++) {
        struct trainer_opts o = nvme_model(cfg, sizeof(cfg), k ? "once" : "twice", "1M", "2M");
        o.no_start_checkpoint = k == 1;
        o.steps = 3;
        struct trainer *t = NULL;
        cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
        struct zinf_stats st;
        zinf_stats(trainer_engine(t), &st);
        opened[k] = st.tier[ZINF_TIER_NVME].used_bytes;
        char swap[4096];
        snprintf(swap, sizeof(swap), "%s/%s", dir, k ? "once" : "twice");
        size_t n = 0;
        int saved = zinf_saved_tensors(swap, &n);
        if (k)
            cr_assert(saved < 0 || n == 0, "step 0 was saved: %zu tensors", n);
        else
            cr_assert(saved == 0 && n > 0, "step 0 was not saved");
        for (int s = 0; s < 3; s++) {
            struct trainer_step_stats ss;
            cr_assert_eq(trainer_step(t, &ss), 0);
            (k ? got : ref)[s] = ss.loss;
        }
        struct trainer_summary sum;
        trainer_get_summary(t, &sum);
        cr_assert_eq(sum.checkpoint_step, k ? -1 : 0);
        zinf_stats(trainer_engine(t), &st);
        peak[k] = st.tier[ZINF_TIER_NVME].peak_bytes;
        trainer_close(t); /* flushed: saved now */
        cr_assert_eq(zinf_saved_tensors(swap, &n), 0);
        cr_assert_gt(n, 0);
    }
    expect_bitwise(got, ref, "without the start checkpoint");
    cr_expect_eq(opened[0], opened[1]);
    cr_expect_eq(peak[1], opened[1], "once: the peak %llu is the state as opened, %llu",
                 (unsigned long long)peak[1], (unsigned long long)opened[1]);
    cr_expect_gt(peak[0], opened[0] + opened[0] / 2, "twice: the peak %llu over %llu opened",
                 (unsigned long long)peak[0], (unsigned long long)opened[0]);
    /* It resumes from what the close saved. */
    struct trainer_opts o = nvme_model(cfg, sizeof(cfg), "once", "1M", "2M");
    o.no_start_checkpoint = true; /* a resumed run is not a new one: nothing changes */
    o.resume = true;
    o.steps = 4;
    struct trainer *t = NULL;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(trainer_next_step(t), 4);
    struct trainer_summary sum;
    trainer_get_summary(t, &sum);
    cr_assert_eq(sum.checkpoint_step, 3);
    trainer_close(t);

    /* Torn before any checkpoint: nothing is saved, and a new run starts there as if none
     * had been. */
    o = nvme_model(cfg, sizeof(cfg), "torn", "1M", "2M");
    o.no_start_checkpoint = true;
    t = NULL;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    trainer_fault_optimizer(t, 3, EIO);
    struct trainer_step_stats ss;
    cr_assert_eq(trainer_step(t, &ss), -EIO);
    trainer_get_summary(t, &sum);
    cr_assert(sum.torn);
    cr_assert_eq(sum.checkpoint_step, -1);
    trainer_close(t);
    char swap[4096];
    size_t n = 0;
    snprintf(swap, sizeof(swap), "%s/torn", dir);
    int saved = zinf_saved_tensors(swap, &n);
    cr_assert(saved < 0 || n == 0, "a torn run was saved");
    o.resume = false;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "a new run where nothing is saved: %s",
                 err);
    cr_assert_eq(trainer_step(t, &ss), 0);
    cr_assert_eq(ss.loss, ref[0], "the same first step");
    trainer_close(t);
}
