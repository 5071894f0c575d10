/*
 * gpt.h - the math of a decoder-only transformer of GPT-2's shape, on the CPU, in fp32:
 * the reference path of the trainer.
 *
 * The model: token embedding wte (V,C) + position embedding wpe (maxT,C); L blocks of
 *   x = x + attn_proj(attention(qkv(ln1(x))))     causal, NH heads of C/NH
 *   x = x + mlp_proj(gelu(mlp_fc(ln2(x))))        fc to 4C, GELU (tanh approximation)
 * then a final LayerNorm lnf and an LM head tied to wte, with a cross-entropy loss whose
 * value is the mean over the B*T targets.
 *
 * The functions work on caller-provided pointers, one piece at a time (the embedding, one
 * block, the head), and never own or allocate the parameters: the trainer keeps every
 * parameter, gradient and optimizer state wherever it likes (in zinf, fetched block by
 * block) and hands the pointers in. Gradients are always accumulated (+=), so a caller
 * zeroes them once per step. Activations are not kept between calls: a block's backward
 * recomputes the block's internals from its input (activation checkpointing), so a
 * trainer keeps only each block's input (B,T,C) between the forward and the backward.
 * One scratch buffer, sized by gpt_scratch_bytes(), serves every call.
 *
 * Results are deterministic for a fixed thread count: every reduction runs in a fixed
 * order (no atomics); GEMMs go to cblas_sgemm (row-major), loops to OpenMP.
 *
 * Not here: the optimizer (adamw.h), the data loader, where tensors live, any GPU code.
 */
#ifndef ZINF_TRAIN_GPT_H
#define ZINF_TRAIN_GPT_H

#include <stddef.h>
#include <stdint.h>

struct gpt_config {
    int V;    /* vocabulary size; 256 for bytes */
    int maxT; /* longest sequence, rows of wpe */
    int L;    /* blocks */
    int C;    /* channels */
    int NH;   /* attention heads; C % NH == 0 */
};

/* A byte-level model of GPT-2 small's shape: V=256, maxT=1024, L=12, C=768, NH=12. */
void gpt_config_defaults(struct gpt_config *cfg);
/* 0, or -EINVAL with a sentence saying what is wrong written to msg (when msg is not NULL).
 * Every other function checks the config with this and answers -EINVAL the same way. */
int gpt_config_validate(const struct gpt_config *cfg, char *msg, size_t msg_len);

/* The tensors of one block, in the order they are laid out in a contiguous block. */
enum gpt_block_slot {
    GPT_LN1_W,       /* (C) */
    GPT_LN1_B,       /* (C) */
    GPT_QKV_W,       /* (3C,C) */
    GPT_QKV_B,       /* (3C) */
    GPT_ATTN_PROJ_W, /* (C,C) */
    GPT_ATTN_PROJ_B, /* (C) */
    GPT_LN2_W,       /* (C) */
    GPT_LN2_B,       /* (C) */
    GPT_FC_W,        /* (4C,C) */
    GPT_FC_B,        /* (4C) */
    GPT_MLP_PROJ_W,  /* (C,4C) */
    GPT_MLP_PROJ_B,  /* (C) */
    GPT_BLOCK_NSLOTS
};

/* The tensors outside the blocks; gpt_tensor_desc.slot for block == -1. */
enum gpt_top_slot { GPT_WTE, GPT_WPE, GPT_LNF_W, GPT_LNF_B };

/* One block's parameters, or its gradients, indexed by enum gpt_block_slot. The pointers
 * may come from anywhere (one contiguous block, or 12 separately fetched tensors). */
struct gpt_block_params {
    const float *t[GPT_BLOCK_NSLOTS];
};
struct gpt_block_grads {
    float *t[GPT_BLOCK_NSLOTS];
};

/* One tensor of the model, as the trainer registers it. */
struct gpt_tensor_desc {
    char name[32];   /* "wte", "wpe", "h3.attn.qkv.w", "lnf.b" */
    int block;       /* 0..L-1 for a block's tensor, -1 for wte, wpe, lnf.w, lnf.b */
    int slot;        /* enum gpt_block_slot when block >= 0, enum gpt_top_slot otherwise */
    int ndim;        /* 1 or 2 */
    size_t shape[2]; /* (rows, cols); shape[1] is 1 when ndim is 1 */
    size_t numel;
    size_t offset; /* in floats, from the start of the contiguous parameter buffer */
};

/* The contiguous parameter buffer of gpt_model_*() holds, in this order: wte, wpe, the L
 * blocks (each its 12 tensors in enum gpt_block_slot order), lnf.w, lnf.b. */
size_t gpt_num_params(const struct gpt_config *cfg);       /* floats, whole model */
size_t gpt_block_num_params(const struct gpt_config *cfg); /* floats, one block */
/* The name of a block slot without the "hN." prefix ("attn.qkv.w"); NULL out of range. */
const char *gpt_block_slot_name(int slot);
/* The tensor count (2 + 12 L + 2), writing the first min(cap, count) descriptions to
 * out (out may be NULL when cap is 0); -EINVAL for a bad config. */
int gpt_layout(const struct gpt_config *cfg, struct gpt_tensor_desc *out, size_t cap);
/* Point p (or g) at the 12 tensors of a contiguous block of gpt_block_num_params() floats. */
void gpt_block_params_at(const struct gpt_config *cfg, const float *block,
                         struct gpt_block_params *p);
void gpt_block_grads_at(const struct gpt_config *cfg, float *block, struct gpt_block_grads *g);

/* GPT-2's initialisation of one tensor: LayerNorm weights 1, biases 0, the rest normal
 * with std 0.02, scaled by 1/sqrt(2L) for the two projections into the residual stream.
 * The values depend only on (seed, d->name), not on where or in which order it runs. */
int gpt_init_tensor(const struct gpt_config *cfg, const struct gpt_tensor_desc *d, float *data,
                    uint64_t seed);

/* Scratch for every call below: recomputed activations and their gradients for one block,
 * or the head's logits. Allocate gpt_scratch_bytes(cfg, B, T) once for the largest (B,T)
 * used; any alignment will do. Its content does not survive between calls. */
struct gpt_scratch {
    void *mem;
    size_t bytes;
};
size_t gpt_scratch_bytes(const struct gpt_config *cfg, int B, int T);

/* Tokens are int in [0,V); every call checks them and answers -EINVAL for one out of range,
 * as for B < 1, T < 1, T > maxT, a NULL pointer or scratch smaller than gpt_scratch_bytes(). */

/* x (B,T,C) = wte[tokens] + wpe[t]. wte is (V,C), wpe (maxT,C), tokens (B,T). */
int gpt_embed_forward(const struct gpt_config *cfg, int B, int T, const float *wte,
                      const float *wpe, const int *tokens, float *x);
/* d_wte (V,C) += scatter of d_x (B,T,C) by token; d_wpe (maxT,C) += sum over b of d_x. */
int gpt_embed_backward(const struct gpt_config *cfg, int B, int T, const int *tokens,
                       const float *d_x, float *d_wte, float *d_wpe);

/* x_out (B,T,C) = block(x_in (B,T,C)). x_out may be x_in. */
int gpt_block_forward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                      const float *x_in, float *x_out, struct gpt_scratch *s);
/* Recomputes the block from x_in (B,T,C), then d_in (B,T,C) = d_out (B,T,C) pulled back
 * through the block, and g += the parameter gradients. d_in may be d_out. */
int gpt_block_backward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                       const float *x_in, const float *d_out, float *d_in,
                       struct gpt_block_grads *g, struct gpt_scratch *s);

/* The block's two halves, for a block whose MLP is something else (a mixture of experts,
 * moe.h): the attention half x2 = x_in + attn_proj(attention(qkv(ln1(x_in)))), slots
 * GPT_LN1_W..GPT_ATTN_PROJ_B of p, and the MLP half x_out = x2 + mlp_proj(gelu(mlp_fc(ln2(
 * x2)))), slots GPT_LN2_W..GPT_MLP_PROJ_B (the other slots may be NULL). Composed, they give
 * gpt_block_forward's and gpt_block_backward's bits: the same ops in the same order. The
 * backwards recompute their half from its input: gpt_mlp_backward writes d_x2 = dloss/dx2
 * from d_out (d_x2 may be d_out), gpt_attn_backward d_in from d_x2 (d_in may be d_x2);
 * g += the half's parameter gradients. */
int gpt_attn_forward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                     const float *x_in, float *x2, struct gpt_scratch *s);
int gpt_mlp_forward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                    const float *x2, float *x_out, struct gpt_scratch *s);
int gpt_attn_backward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                      const float *x_in, const float *d_x2, float *d_in, struct gpt_block_grads *g,
                      struct gpt_scratch *s);
int gpt_mlp_backward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                     const float *x2, const float *d_out, float *d_x2, struct gpt_block_grads *g,
                     struct gpt_scratch *s);

/* loss = mean over (b,t) of -log softmax(lnf(x) @ wte^T)[targets]. x is the last block's
 * output (B,T,C), lnf_w and lnf_b (C), wte (V,C), targets (B,T). logits (B,T,V) may be NULL;
 * when given, the logits are written there. loss may be NULL. */
int gpt_head_forward(const struct gpt_config *cfg, int B, int T, const float *lnf_w,
                     const float *lnf_b, const float *wte, const float *x, const int *targets,
                     float *loss, float *logits, struct gpt_scratch *s);
/* Recomputes the head from x, writes d_x (B,T,C) = dloss/dx (d_x may be x) and accumulates
 * d_lnf_w, d_lnf_b (C) and d_wte (V,C); d_wte may be NULL (a frozen wte: no gradient of
 * it is computed). loss (may be NULL) receives the forward's value. */
int gpt_head_backward(const struct gpt_config *cfg, int B, int T, const float *lnf_w,
                      const float *lnf_b, const float *wte, const float *x, const int *targets,
                      float *d_x, float *d_lnf_w, float *d_lnf_b, float *d_wte, float *loss,
                      struct gpt_scratch *s);

/* The whole model over one contiguous buffer of gpt_num_params() floats, laid out as
 * gpt_layout() says: the in-memory reference that the block-by-block path is checked
 * against. They allocate their own working memory (-ENOMEM when that fails). */
int gpt_model_init(const struct gpt_config *cfg, float *params, uint64_t seed);
int gpt_model_forward(const struct gpt_config *cfg, int B, int T, const float *params,
                      const int *tokens, const int *targets, float *loss);
/* Keeps every activation of the forward (no recompute) and runs the backward from them;
 * grads (gpt_num_params() floats, same layout) += dloss/dparams. loss may be NULL. */
int gpt_model_backward(const struct gpt_config *cfg, int B, int T, const float *params,
                       const int *tokens, const int *targets, float *grads, float *loss);

#endif
