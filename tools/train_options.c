/*
 * train_options.c - the command-line options that shape the model and the run
 * (train_options.h): their names, their ranges, and a value into the trainer's options.
 * Not here: what a config does under them (src/train/train_config.c).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "train/gpt_lora.h"
#include "train_options.h"

const struct option train_shape_options[] = {TRAIN_SHAPE_OPTIONS, {0}};

static int int_arg(const char *name, const char *s, long lo, long hi, long *out, char *err,
                   size_t errlen)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) {
        snprintf(err, errlen, "--%s: expected an integer in %ld..%ld, got '%s'", name, lo, hi, s);
        return -EINVAL;
    }
    *out = v;
    return 0;
}

static int float_arg(const char *name, const char *s, float *out, char *err, size_t errlen)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || end == s || !(v >= 0)) {
        snprintf(err, errlen, "--%s: expected a number >= 0, got '%s'", name, s);
        return -EINVAL;
    }
    *out = v;
    return 0;
}

int train_option_apply(int opt, const char *arg, struct trainer_opts *o, unsigned *given,
                       char *err, size_t errlen)
{
    /* The integers' ranges: what each field holds, and what a person would mean. */
    static const struct {
        int opt;
        long lo, hi;
    } ints[] = {{O_LAYERS, 1, 1024}, {O_DIM, 1, 65536},         {O_HEADS, 1, 1024},
                {O_SEQ, 1, 65536},   {O_BATCH, 1, 65536},       {O_STEPS, 0, 100000000},
                {O_SEED, 0, 0x7fffffffL}, {O_ACCUM, 1, 65536},
                {O_EXPERTS, 0, 4096}, {O_TOP_K, 1, 2},
                {O_EXPERT_PREFETCH, 0, 64}, {O_LORA_RANK, 1, 65536}};
    const char *name = NULL;
    for (size_t k = 0; train_shape_options[k].name; k++)
        if (train_shape_options[k].val == opt) name = train_shape_options[k].name;
    if (!name) return 0;
    long v = 0;
    int r = 0;
    for (size_t k = 0; k < ARRAY_SIZE(ints); k++)
        if (ints[k].opt == opt && (r = int_arg(name, arg, ints[k].lo, ints[k].hi, &v, err,
                                               errlen)) < 0)
            return r;
    switch (opt) {
    case O_LAYERS: o->model.L = (int)v; break;
    case O_DIM: o->model.C = (int)v; break;
    case O_HEADS: o->model.NH = (int)v; break;
    case O_SEQ: o->seq = (int)v; break;
    case O_BATCH: o->batch = (int)v; break;
    case O_STEPS: o->steps = (int)v; break;
    case O_SEED: o->seed = (uint64_t)v; break;
    case O_ACCUM: o->grad_accum = (int)v; break;
    case O_EXPERTS: o->moe.E = (int)v; break;
    case O_TOP_K: o->moe.k = (int)v; break;
    case O_EXPERT_PREFETCH: o->moe.prefetch = (int)v; break;
    case O_LORA_RANK: o->lora.r = (int)v; break;
    case O_LORA_ALPHA: r = float_arg(name, arg, &o->lora.alpha, err, errlen); break;
    case O_LORA_DROPOUT: r = float_arg(name, arg, &o->lora.dropout, err, errlen); break;
    case O_LORA_TARGETS:
        if ((r = gpt_lora_parse_targets(arg)) < 0)
            snprintf(err, errlen, "--lora-targets: expected a comma-separated list of c_attn, "
                     "c_proj and c_fc (PEFT's names of GPT-2's linears), got '%s'", arg);
        else
            o->lora.targets = (unsigned)r;
        break;
    case O_LR: r = float_arg(name, arg, &o->lr, err, errlen); break;
    case O_WD: r = float_arg(name, arg, &o->weight_decay, err, errlen); break;
    case O_CLIP: r = float_arg(name, arg, &o->grad_clip, err, errlen); break;
    case O_PRECISION:
        if (!strcmp(arg, "auto"))
            o->precision = TRAINER_PRECISION_AUTO;
        else if (!strcmp(arg, "fp32"))
            o->precision = TRAINER_PRECISION_FP32;
        else if (!strcmp(arg, "bf16"))
            o->precision = TRAINER_PRECISION_BF16;
        else if (!strcmp(arg, "fp16"))
            o->precision = TRAINER_PRECISION_FP16;
        else {
            snprintf(err, errlen, "--precision: expected auto, fp32, bf16 or fp16, got '%s'", arg);
            r = -EINVAL;
        }
        break;
    }
    if (r < 0) return r;
    *given |= 1u << (opt - O_LAYERS);
    return 1;
}
