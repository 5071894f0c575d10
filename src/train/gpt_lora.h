/*
 * gpt_lora.h - low-rank adapters (LoRA) on a frozen GPT block, on the CPU, in fp32.
 *
 * A targeted linear y = x W^T + b of the block (W (out,in)) becomes
 *   y = x W^T + b + scale * (x A^T) B^T,    A (r,in), B (out,r), scale = alpha / r
 * as PEFT's LoRA layers compute it (dropout 0). The base weights are read only: the
 * backward pulls the gradient through them and writes no gradient of theirs; only the
 * adapters' gradients are accumulated (+=). With B = 0 (PEFT's start) the block's output is
 * gpt_block_forward's, bit for bit: the same ops in the same order, and then + 0.
 *
 * The targets, by GPT-2's module names as PEFT's target_modules give them: c_attn (qkv),
 * c_proj (both the attention's and the MLP's projections), c_fc (the MLP's fc).
 *
 * Not here: where the adapters live, the optimizer, any GPU code.
 */
#ifndef ZINF_TRAIN_GPT_LORA_H
#define ZINF_TRAIN_GPT_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "train/gpt.h"

/* The block's linears an adapter can sit on, in the order a block's adapters are laid out. */
enum gpt_lora_target {
    GPT_LORA_QKV,       /* GPT_QKV_W: HF's attn.c_attn */
    GPT_LORA_ATTN_PROJ, /* GPT_ATTN_PROJ_W: attn.c_proj */
    GPT_LORA_FC,        /* GPT_FC_W: mlp.c_fc */
    GPT_LORA_MLP_PROJ,  /* GPT_MLP_PROJ_W: mlp.c_proj */
    GPT_LORA_NTARGETS
};
#define GPT_LORA_ALL ((1u << GPT_LORA_NTARGETS) - 1)

/* The block slot of target j's base weight, and its (out, in). */
int gpt_lora_slot(int j);
void gpt_lora_dims(const struct gpt_config *cfg, int j, size_t *out, size_t *in);
/* HF's module of target j under a block ("attn.c_attn", "mlp.c_proj"); NULL out of range. */
const char *gpt_lora_hf_module(int j);
/* The name of block k's adapter A (ab 0) or B (ab 1) of target j as the trainer registers
 * it: "h3.attn.qkv.lora_a". */
void gpt_lora_name(int k, int j, int ab, char *buf, size_t len);
/* The targets named by a comma-separated list of PEFT's names ("c_attn,c_proj"): a mask of
 * 1 << enum gpt_lora_target, or -EINVAL (an unknown or empty name). */
int gpt_lora_parse_targets(const char *list);
/* The mask as PEFT's names, comma-separated, into buf. */
const char *gpt_lora_targets_name(unsigned mask, char *buf, size_t len);

/* One block's adapters, or their gradients: a[j], b[j] NULL where target j has none. */
struct gpt_lora_params {
    int r;       /* rank */
    float scale; /* alpha / r */
    const float *a[GPT_LORA_NTARGETS], *b[GPT_LORA_NTARGETS];
};
struct gpt_lora_grads {
    float *a[GPT_LORA_NTARGETS], *b[GPT_LORA_NTARGETS];
};

/* PEFT's start of adapter A of target j in block k: kaiming-uniform with a = sqrt(5), that is
 * uniform in [-1/sqrt(in), 1/sqrt(in)], from a stream that depends on (seed, k, j) only. */
void gpt_lora_init_a(const struct gpt_config *cfg, int k, int j, int r, float *a, uint64_t seed);

/* Scratch for the calls below, for the largest (B,T) used and rank r. */
size_t gpt_lora_scratch_bytes(const struct gpt_config *cfg, int B, int T, int r);

/* x_out (B,T,C) = the block with its adapters (x_in). x_out may be x_in. */
int gpt_lora_block_forward(const struct gpt_config *cfg, int B, int T,
                           const struct gpt_block_params *p, const struct gpt_lora_params *l,
                           const float *x_in, float *x_out, struct gpt_scratch *s);
/* Recomputes the block from x_in, d_in = d_out pulled back through it (d_in may be d_out,
 * not x_in), and g += the adapters' gradients; the base weights get none. */
int gpt_lora_block_backward(const struct gpt_config *cfg, int B, int T,
                            const struct gpt_block_params *p, const struct gpt_lora_params *l,
                            const float *x_in, const float *d_out, float *d_in,
                            struct gpt_lora_grads *g, struct gpt_scratch *s);

#endif
