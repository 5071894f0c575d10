/*
 * test_train_gpu.c - the trainer on a GPU (the gpu suite): the CUDA backend against the CPU
 * reference on the same model and batches, in fp32 and with bf16 and fp16 weights (fp16 with
 * DeepSpeed's loss scaling, overflow included); offloaded (the model's state many times the
 * device budget, streamed from NVMe) against resident; and the 16-bit copies on the device
 * equal to the fp32 masters rounded. Skips where no GPU is usable or the build has no CUDA
 * kernels.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common.h"
#include "helpers.h"
#include "tiers/cuda_probe.h"
#include "train/backend.h"
#include "train/ops.h"
#include "train/trainer.h"

#define STEPS 8

static char *dir;
static char data_path[4096];

static void setup(void)
{
    dir = test_tmpdir("train_gpu");
    cr_assert_not_null(dir);
    test_write_training_text(dir, data_path, sizeof(data_path));
}

static void teardown(void)
{
    test_rmtree(dir);
}

TestSuite(train_gpu, .init = setup, .fini = teardown, .timeout = 300);

static void need_gpu(void)
{
    struct cuda_probe_info ci;
    if (!backend_cuda_built()) cr_skip_test("built without the CUDA kernels");
    if (cuda_probe(&ci) <= 0) cr_skip_test("no usable GPU: %s", ci.reason);
}

/* A config with the given device kind and offload; swap may be NULL (no NVMe). The host
 * tier is pinned (and registered with CUDA), so the engine's copies are asynchronous. */
static void write_config(const char *path, const char *device, const char *param, const char *optim,
                         const char *swap, const char *device_bytes, const char *host_bytes)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"zero_optimization\": {\"stage\": 3,"
            " \"offload_param\": {\"device\": \"%s\", \"pin_memory\": true%s%s%s},"
            " \"offload_optimizer\": {\"device\": \"%s\", \"pin_memory\": true%s%s%s}},"
            " \"aio\": {\"block_size\": 262144, \"queue_depth\": 16},"
            " \"zinf\": {\"device\": \"%s\", \"device_bytes\": \"%s\", \"host_bytes\": \"%s\"}}",
            param, swap ? ", \"nvme_path\": \"" : "", swap ? swap : "", swap ? "\"" : "", optim,
            swap ? ", \"nvme_path\": \"" : "", swap ? swap : "", swap ? "\"" : "", device,
            device_bytes, host_bytes);
    fclose(f);
}

static struct trainer_opts model(const char *config, enum trainer_precision p)
{
    struct trainer_opts o;
    trainer_opts_defaults(&o);
    o.config_path = config;
    o.data_path = data_path;
    o.model.L = 4;
    o.model.C = 128;
    o.model.NH = 4;
    o.seq = 64;
    o.batch = 4;
    o.steps = STEPS;
    o.lr = 1e-3f;
    o.seed = 11;
    o.precision = p;
    return o;
}

static void run(struct trainer_opts *o, float *losses, struct trainer_summary *sum)
{
    struct trainer *t = NULL;
    char err[512];
    int r = trainer_open(o, &t, err, sizeof(err));
    cr_assert_eq(r, 0, "trainer_open: %s (%s)", err, zinf_strerror(r));
    for (int i = 0; i < o->steps; i++) {
        struct trainer_step_stats st;
        cr_assert_eq(trainer_step(t, &st), 0, "step %d", i + 1);
        losses[i] = st.loss;
    }
    cr_assert_eq(trainer_checkpoint(t), 0);
    trainer_get_summary(t, sum);
    trainer_close(t);
}

static const char *mkpath(const char *name, char *buf, size_t len)
{
    snprintf(buf, len, "%s/%s", dir, name);
    return buf;
}

/* The same model and batches on the CPU in fp32 and on the GPU in gpu_precision, everything
 * resident; the largest relative loss difference over the steps is reported and held to
 * tolerance. With fp16 the GPU's summary is handed back in *fp16_sum when it is not NULL. */
static void cpu_against_gpu(enum trainer_precision gpu_precision, const char *want_precision,
                            double tolerance, struct trainer_summary *fp16_sum)
{
    char cc[4096], cg[4096];
    float cpu[STEPS], gpu[STEPS];
    struct trainer_summary sc, sg;
    write_config(mkpath("cpu.json", cc, sizeof(cc)), "emulated", "none", "none", NULL, "256M",
                 "64M");
    write_config(mkpath("gpu.json", cg, sizeof(cg)), "cuda", "none", "none", NULL, "256M", "64M");
    struct trainer_opts o = model(cc, TRAINER_PRECISION_FP32);
    run(&o, cpu, &sc);
    o = model(cg, gpu_precision);
    run(&o, gpu, &sg);
    cr_assert_str_eq(sc.backend, "cpu");
    cr_assert_str_eq(sg.backend, "cuda");
    cr_assert_str_eq(sg.precision, want_precision);
    double worst = 0;
    for (int i = 0; i < STEPS; i++) {
        worst = fmax(worst, fabs((double)gpu[i] - cpu[i]) / cpu[i]);
        cr_log_info("step %d: cpu fp32 %.6f gpu %s %.6f", i + 1, cpu[i], want_precision, gpu[i]);
    }
    cr_log_info("%s: largest relative loss difference %.3g (tolerance %g)", want_precision, worst,
                tolerance);
    cr_assert_leq(worst, tolerance, "largest relative loss difference %.3g", worst);
    cr_assert_lt(gpu[STEPS - 1], gpu[0], "the loss falls on the GPU");
    if (fp16_sum) *fp16_sum = sg;
}

/* Sums run in other orders on the GPU; over 8 steps the losses agree to 1e-4. */
Test(train_gpu, fp32_on_the_gpu_matches_the_cpu)
{
    need_gpu();
    cpu_against_gpu(TRAINER_PRECISION_FP32, "fp32", 1e-4, NULL);
}

/* bf16 weights and activations (auto on a GPU): within 2% of the fp32 reference. */
Test(train_gpu, bf16_on_the_gpu_tracks_fp32)
{
    need_gpu();
    cpu_against_gpu(TRAINER_PRECISION_AUTO, "bf16", 2e-2, NULL);
}

/* fp16 weights and activations with DeepSpeed's dynamic loss scale (2^16 at first): within
 * 2% of the fp32 reference, and every step applied (this model's scaled gradients fit fp16;
 * the next test makes them overflow). */
Test(train_gpu, fp16_on_the_gpu_tracks_fp32)
{
    need_gpu();
    struct trainer_summary s;
    cpu_against_gpu(TRAINER_PRECISION_FP16, "fp16", 2e-2, &s);
    cr_log_info("fp16: %lld steps skipped, loss scale now %g", (long long)s.skipped_steps,
                s.loss_scale);
    cr_assert_eq(s.skipped_steps, 0);
    cr_assert_eq(s.loss_scale, 65536.0);
}

/* A loss scale of 2^25 makes the cross-entropy's fp16 gradient overflow on the GPU itself
 * ((p - 1) 2^25 / N is past 65504 for this batch of N = 256): the step is skipped, the
 * parameters stay as they were, and the scale halves (hysteresis 1) until the gradients fit
 * and the loss falls. */
Test(train_gpu, fp16_overflow_on_the_gpu_skips_the_step_and_lowers_the_scale)
{
    need_gpu();
    char cg[4096];
    write_config(mkpath("gpu16.json", cg, sizeof(cg)), "cuda", "none", "none", NULL, "256M", "64M");
    struct trainer_opts o = model(cg, TRAINER_PRECISION_FP16);
    o.fp16.initial_scale_power = 25;
    o.fp16.hysteresis = 1;
    struct trainer *t = NULL;
    char err[512];
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    zinf_engine *e = trainer_engine(t);
    zinf_tensor hp;
    size_t n = 4 * 128 * 128;
    float *before = malloc(n * 4), *after = malloc(n * 4);
    cr_assert(before && after);
    cr_assert_eq(zinf_lookup(e, "p.h3.mlp.fc.w", &hp), 0);
    cr_assert_eq(zinf_read(e, hp, 0, before, n * 4), 0);
    struct trainer_step_stats st;
    cr_assert_eq(trainer_step(t, &st), 0);
    cr_assert(st.skipped, "step 1 ran with scale %g and was not skipped", st.loss_scale);
    cr_assert_eq(st.loss_scale, 0x1p25);
    cr_assert_eq(zinf_read(e, hp, 0, after, n * 4), 0);
    cr_assert_eq(memcmp(before, after, n * 4), 0, "a skipped step changed a parameter");
    float first = st.loss, last = st.loss;
    int skipped = 1, applied = 0;
    for (int i = 1; i < 3 * STEPS; i++) {
        cr_assert_eq(trainer_step(t, &st), 0, "step %d", i + 1);
        cr_assert(isfinite(st.loss), "step %d: loss %g", i + 1, st.loss);
        skipped += st.skipped;
        applied += !st.skipped;
        last = st.loss;
    }
    struct trainer_summary s;
    trainer_get_summary(t, &s);
    cr_log_info("fp16 from 2^25: %d steps skipped, %d applied, loss scale now %g, loss %.4f -> "
                "%.4f",
                skipped, applied, s.loss_scale, first, last);
    cr_assert_eq(s.skipped_steps, skipped);
    cr_assert_lt(s.loss_scale, 0x1p25);
    cr_assert_geq(applied, STEPS, "the scale came down to one the gradients fit");
    cr_assert_lt(last, first, "the loss falls once steps apply");
    free(before);
    free(after);
    trainer_close(t);
}

/* precision is bf16 or fp16; narrow its CPU cast of fp32. */
static void offloaded_equals_resident(enum trainer_precision precision, const char *name,
                                      uint16_t (*narrow)(float))
{
    need_gpu();
    char cm[4096], cn[4096], swap[4096];
    float res[STEPS], off[STEPS];
    struct trainer_summary sm, sn;
    mkpath("swap", swap, sizeof(swap));
    cr_assert_eq(mkdir(swap, 0755), 0);
    /* The optimizer runs on the host in both (the same AdamW bits); only where the weights,
     * gradients and states live differs. */
    write_config(mkpath("mem.json", cm, sizeof(cm)), "cuda", "none", "cpu", NULL, "256M", "64M");
    write_config(mkpath("nvme.json", cn, sizeof(cn)), "cuda", "nvme", "nvme", swap, "2M", "4M");
    struct trainer_opts o = model(cm, precision);
    run(&o, res, &sm);
    o = model(cn, precision);
    run(&o, off, &sn);
    for (int i = 0; i < STEPS; i++)
        cr_assert(memcmp(&res[i], &off[i], sizeof(float)) == 0,
                  "%s step %d: %.9g resident, %.9g offloaded", name, i + 1, res[i], off[i]);
    cr_assert_geq(sn.model_state_bytes, 4 * sn.tier[ZINF_TIER_DEVICE].budget_bytes);
    cr_assert_leq(sn.tier[ZINF_TIER_DEVICE].peak_bytes, sn.tier[ZINF_TIER_DEVICE].budget_bytes);

    /* The 16-bit copy of each parameter, read back through the engine (from wherever its
     * newest version is, the GPU included), is its fp32 master rounded. */
    struct trainer *t = NULL;
    char err[512];
    o.resume = true;
    cr_assert_eq(trainer_open(&o, &t, err, sizeof(err)), 0, "%s", err);
    zinf_engine *e = trainer_engine(t);
    const char *names[] = {"wte", "h0.attn.qkv.w", "h3.mlp.fc.w", "lnf.b"};
    size_t C = 128, numel[] = {256 * C, 3 * C * C, 4 * C * C, C};
    for (size_t k = 0; k < 4; k++) {
        char pn[64], wn[64];
        zinf_tensor hp, hw;
        snprintf(pn, sizeof(pn), "p.%s", names[k]);
        snprintf(wn, sizeof(wn), "w.%s", names[k]);
        cr_assert_eq(zinf_lookup(e, pn, &hp), 0);
        cr_assert_eq(zinf_lookup(e, wn, &hw), 0);
        float *p = malloc(numel[k] * 4);
        uint16_t *w = malloc(numel[k] * 2);
        cr_assert_eq(zinf_read(e, hp, 0, p, numel[k] * 4), 0);
        cr_assert_eq(zinf_read(e, hw, 0, w, numel[k] * 2), 0);
        for (size_t i = 0; i < numel[k]; i++)
            cr_assert_eq(w[i], narrow(p[i]), "%s %s[%zu]", name, names[k], i);
        free(p);
        free(w);
    }
    trainer_close(t);
}

Test(train_gpu, offloaded_equals_resident_and_copies_are_the_rounded_masters)
{
    offloaded_equals_resident(TRAINER_PRECISION_BF16, "bf16", ops_f32_to_bf16);
}

Test(train_gpu, fp16_offloaded_equals_resident_and_copies_are_the_rounded_masters)
{
    offloaded_equals_resident(TRAINER_PRECISION_FP16, "fp16", ops_f32_to_f16);
}

/* Compressed Adam states (zinf.optimizer_state_dtype) homed on the device, updated by
 * kernels/adamw_states.cu: each dtype's losses on the GPU track the CPU's with the same
 * dtype as fp32's do (the gradients differ in their last bits, and so then do the states). */
Test(train_gpu, compressed_optimizer_states_on_the_gpu_track_the_cpu)
{
    need_gpu();
    char cc[4096], cg[4096];
    float cpu[STEPS], gpu[STEPS];
    struct trainer_summary sc, sg;
    write_config(mkpath("cpu.json", cc, sizeof(cc)), "emulated", "none", "none", NULL, "256M",
                 "64M");
    write_config(mkpath("gpu.json", cg, sizeof(cg)), "cuda", "none", "none", NULL, "256M", "64M");
    for (int dt = 1; dt <= 2; dt++) {
        struct trainer_opts o = model(cc, TRAINER_PRECISION_FP32);
        o.state_dtype = dt;
        run(&o, cpu, &sc);
        o = model(cg, TRAINER_PRECISION_FP32);
        o.state_dtype = dt;
        run(&o, gpu, &sg);
        cr_assert_str_eq(sg.backend, "cuda");
        cr_assert_str_eq(sg.optimizer_state_dtype, dt == 1 ? "bf16" : "int8");
        double worst = 0;
        for (int i = 0; i < STEPS; i++) {
            cr_assert(isfinite(gpu[i]));
            worst = fmax(worst, fabs((double)gpu[i] - cpu[i]) / cpu[i]);
        }
        cr_log_info("%s states: largest relative loss difference %.3g", sg.optimizer_state_dtype,
                    worst);
        cr_assert_leq(worst, 1e-3, "%s: largest relative loss difference %.3g",
                      sg.optimizer_state_dtype, worst);
    }
}
