/*
 * test_grad_comm.c - the gradients' communication across ranks, through `zinf launch` and
 * `zinf train` as a user runs them: communication_data_type fp16 and bf16 (each rank's
 * contribution rounded to 16 bits, the sums fp32 in rank order) give the fp32 reduction's
 * losses within the rounding they add, the same bits run to run, and half its bytes; 1-bit
 * Adam (OneBitAdam) runs plain Adam bitwise until freeze_step and then the compressed
 * exchange of the momentum, its losses finite and near Adam's; wrong values are refused
 * naming the key.
 *
 * Not here: the collectives themselves (test_comm.c), the arithmetic against DeepSpeed's
 * (scripts/check-onebit.sh).
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "helpers.h"

static char *dir;

static void setup(void)
{
    dir = test_tmpdir("grad_comm");
    cr_assert_not_null(dir);
}

static void teardown(void)
{
    test_leak_check();
    test_rmtree(dir);
}

TestSuite(grad_comm, .init = setup, .fini = teardown, .timeout = 120);

#define run test_run_zinf
#define DATA "/usr/share/common-licenses/GPL-3"
#define STEPS 6

/* A small model's config, `extra` inside the top object. */
static void config(char *path, size_t len, const char *name, const char *extra)
{
    snprintf(path, len, "%s/%s.json", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"train_micro_batch_size_per_gpu\": 2, \"gradient_accumulation_steps\": 1, %s"
            " \"zinf\": {\"device\": \"emulated\", \"train\": {\"layers\": 2, \"dim\": 32, "
            "\"heads\": 4, \"seq\": 16, \"seed\": 5}}}",
            extra);
    fclose(f);
}

/* Each step's line of the log: its loss as a value and as text, its digest, its bytes. */
struct steps {
    double loss[STEPS + 1];
    char bits[STEPS + 1][96];
    unsigned long long comm[STEPS + 1], grad[STEPS + 1];
    int n;
};

static void read_steps(const char *log, struct steps *s)
{
    FILE *f = fopen(log, "r");
    char line[1 << 14];
    cr_assert_not_null(f, "%s", log);
    memset(s, 0, sizeof(*s));
    while (fgets(line, sizeof(line), f)) {
        json_t *j = json_loads(line, 0, NULL);
        cr_assert_not_null(j, "%s: %s", log, line);
        json_t *st = json_object_get(j, "step");
        if (st && json_integer_value(st) >= 1 && json_integer_value(st) <= STEPS) {
            int k = (int)json_integer_value(st);
            char *loss = json_dumps(json_object_get(j, "loss"), JSON_ENCODE_ANY);
            const char *dg = json_string_value(json_object_get(j, "digest"));
            snprintf(s->bits[k], sizeof(s->bits[k]), "%s %s", loss, dg ? dg : "-");
            free(loss);
            s->loss[k] = json_number_value(json_object_get(j, "loss"));
            s->comm[k] = (unsigned long long)json_integer_value(json_object_get(j, "comm_bytes"));
            s->grad[k] =
                (unsigned long long)json_integer_value(json_object_get(j, "grad_comm_bytes"));
            s->n = MAX(s->n, k);
        }
        json_decref(j);
    }
    fclose(f);
}

/* A launch of n ranks, STEPS steps with the digest, its log read. */
static void train(int n, const char *cfg, const char *name, struct steps *s)
{
    char log[4096], *o;
    snprintf(log, sizeof(log), "%s/%s.jsonl", dir, name);
    int r = run(&o, "launch -n %d -- %s train --config %s --data " DATA
                    " --steps %d --log %s",
                n, getenv("ZINF_BIN"), cfg, STEPS, log);
    cr_assert_eq(r, 0, "%s: %s", name, o);
    free(o);
    read_steps(log, s);
    cr_assert_eq(s->n, STEPS, "%s", name);
}

/* A config refused: its message names `what`. */
static void refused(const char *extra, const char *what)
{
    char cfg[4096], *o;
    config(cfg, sizeof(cfg), "bad", extra);
    int r = run(&o, "train --config %s --data " DATA " --steps 1", cfg);
    cr_assert_neq(r, 0, "%s: %s", extra, o);
    cr_assert(strstr(o, what), "%s: wanted \"%s\" in: %s", extra, what, o);
    free(o);
}

Test(grad_comm, sixteen_bit_reduction_within_rounding_same_bits_half_the_bytes)
{
    char cfg[4096];
    struct steps f32, h[2][2];
    config(cfg, sizeof(cfg), "f32", "");
    train(2, cfg, "f32", &f32);
    static const char *const types[] = {"fp16", "bf16"};
    for (int d = 0; d < 2; d++) {
        char extra[128], name[32];
        snprintf(extra, sizeof(extra), "\"communication_data_type\": \"%s\",", types[d]);
        config(cfg, sizeof(cfg), types[d], extra);
        for (int again = 0; again < 2; again++) {
            snprintf(name, sizeof(name), "%s-%d", types[d], again);
            train(2, cfg, name, &h[d][again]);
        }
        /* bf16 keeps 8 bits of each gradient, fp16 11: a few steps of Adam stay near. */
        double tol = d == 0 ? 2e-3 : 2e-2;
        for (int k = 1; k <= STEPS; k++) {
            cr_assert_str_eq(h[d][0].bits[k], h[d][1].bits[k], "%s run twice, step %d",
                             types[d], k);
            cr_assert(fabs(h[d][0].loss[k] - f32.loss[k]) <= tol * fabs(f32.loss[k]),
                      "%s step %d: loss %.9g against fp32's %.9g", types[d], k, h[d][0].loss[k],
                      f32.loss[k]);
            cr_assert_gt(f32.grad[k], 0);
            cr_assert_eq(h[d][0].grad[k] * 2, f32.grad[k], "%s step %d: %llu bytes against %llu",
                         types[d], k, h[d][0].grad[k], f32.grad[k]);
            cr_assert_lt(h[d][0].comm[k], f32.comm[k]);
        }
        /* The first step's loss is before any update: the same bits. */
        cr_assert_eq(h[d][0].loss[1], f32.loss[1]);
        /* Rounded: not fp32's parameters after the first update. */
        cr_assert_str_neq(h[d][0].bits[2], f32.bits[2], "%s", types[d]);
    }
}

Test(grad_comm, wrong_values_are_refused_naming_the_key)
{
    refused("\"communication_data_type\": \"int8\",", "communication_data_type \"int8\"");
    refused("\"optimizer\": {\"type\": \"Adam\", \"params\": {\"freeze_step\": 3}},",
            "optimizer.params.freeze_step is OneBitAdam's");
    refused("\"optimizer\": {\"type\": \"ZeroOneAdam\", \"params\": {\"var_freeze_step\": 3}},",
            "0/1 Adam is not built");
}

/* 1-bit Adam on 2 ranks: its warm-up is Adam without bias correction to the bit; past
 * freeze_step the momentum travels as signs (a thirtieth of the gradients' bytes and less),
 * the losses finite and near Adam's, the same bits run to run. */
Test(grad_comm, onebit_adam_warm_up_bitwise_then_compressed)
{
    char cfg[4096];
    struct steps adam, ob[2];
    config(cfg, sizeof(cfg), "adam",
           "\"optimizer\": {\"type\": \"Adam\", \"params\": {\"bias_correction\": false, "
           "\"betas\": [0.9, 0.99]}},");
    train(2, cfg, "adam", &adam);
    config(cfg, sizeof(cfg), "onebit",
           "\"optimizer\": {\"type\": \"OneBitAdam\", \"params\": {\"freeze_step\": 3, "
           "\"betas\": [0.9, 0.99], \"comm_backend_name\": \"nccl\", \"cuda_aware\": false}},");
    train(2, cfg, "onebit", &ob[0]);
    train(2, cfg, "onebit-again", &ob[1]);
    for (int k = 1; k <= STEPS; k++) {
        cr_assert_str_eq(ob[0].bits[k], ob[1].bits[k], "run twice, step %d", k);
        if (k <= 3) {
            cr_assert_str_eq(ob[0].bits[k], adam.bits[k], "warm-up step %d", k);
            cr_assert_eq(ob[0].grad[k], adam.grad[k], "warm-up step %d", k);
            continue;
        }
        cr_assert_str_neq(ob[0].bits[k], adam.bits[k], "compressed step %d", k);
        cr_assert(isfinite(ob[0].loss[k]), "step %d", k);
        cr_assert(fabs(ob[0].loss[k] - adam.loss[k]) <= 0.2 * adam.loss[k],
                  "step %d: loss %.9g against Adam's %.9g", k, ob[0].loss[k], adam.loss[k]);
        cr_assert_gt(ob[0].grad[k], 0);
        cr_assert_lt(ob[0].grad[k] * 16, adam.grad[k], "step %d: %llu bytes against %llu", k,
                     ob[0].grad[k], adam.grad[k]);
    }
}

Test(grad_comm, onebit_adam_refusals_name_the_key)
{
    refused("\"zero_optimization\": {\"stage\": 2}, \"optimizer\": {\"type\": \"OneBitAdam\"},",
            "zero_optimization.stage");
    refused("\"optimizer\": {\"type\": \"OneBitAdam\", \"params\": {\"comm_backend_name\": "
            "\"hccl\"}},",
            "optimizer.params.comm_backend_name \"hccl\"");
    refused("\"optimizer\": {\"type\": \"OneBitAdam\", \"params\": {\"adam_w_mode\": true}},",
            "optimizer.params.adam_w_mode is not OneBitAdam's");
    refused("\"optimizer\": {\"type\": \"OneBitAdam\", \"params\": {\"freeze_step\": 0}},",
            "freeze_step");
}
