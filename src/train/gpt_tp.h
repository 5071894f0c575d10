/*
 * gpt_tp.h - the math of Megatron-style tensor parallelism for the GPT model of gpt.h: how
 * each tensor is cut over tp ranks, and the embedding, one block and the head computed on
 * one rank's slices, with the sums across ranks handed to the caller's collectives.
 *
 * The cut (rank r of tp; NH % tp == 0; C_r = C/tp channels of NH/tp heads per rank):
 *   column-parallel  attn.qkv.w (3C,C)  -> rows of this rank's heads in each of q, k and v:
 *                                          (3 C_r, C), its q rows, then its k, then its v;
 *                    attn.qkv.b (3C)    -> the same rows (3 C_r);
 *                    mlp.fc.w (4C,C)    -> rows [r 4C_r, (r+1) 4C_r): (4 C_r, C); mlp.fc.b too;
 *   row-parallel     attn.proj.w (C,C)  -> the columns of this rank's heads: (C, C_r);
 *                    mlp.proj.w (C,4C)  -> columns [r 4C_r, (r+1) 4C_r): (C, 4 C_r);
 *   replicated       ln1, ln2 (w, b), attn.proj.b, mlp.proj.b, wpe, lnf.w, lnf.b;
 *   vocab-parallel   wte (V,C)          -> rows [V r / tp, V (r+1) / tp), an uneven split
 *                                          where tp does not divide V (V >= tp).
 * A slice is stored contiguous, row-major, in the shape written above.
 *
 * A block on a rank runs ln1 -> its heads' qkv -> attention over its heads -> its partial of
 * attn.proj -> allreduce -> ln2 -> its part of fc -> GELU -> its partial of mlp.proj ->
 * allreduce: two allreduces of (B,T,C) forward and two backward (the input gradients of the
 * two column-parallel linears), as in Megatron-LM. The backward recomputes the block from its
 * input (activation checkpointing) as far as the MLP's GELU, which takes the first of the
 * forward's allreduces again: three in all. Rank 0 starts its partial sums from
 * residual + bias (the one-rank linear's accumulate) and the other ranks from zero, so the
 * allreduce's sum is the output, and at tp == 1 every function gives the bits of gpt.c's.
 * Replicated parameters' gradients come out the same on every rank from the same inputs:
 * they need no reduction across the tp ranks. Gradients accumulate (+=), as in gpt.h.
 *
 * The collectives are the caller's (the trainer's communicator); each must return the same
 * bits on every rank, and a result that depends only on the values (say, a sum in rank
 * order), so that a run depends only on (shape, tp), never on threads or timing. At
 * tp == 1 they are never called and may be NULL. Every rank makes the same calls, in the
 * same order, with the same (cfg, tp, B, T). A callback's negative return is the call's
 * answer, the call stopping there: its outputs and gradients are then partly written, and
 * the step is to be dropped (on every rank: the others may wait in the collective).
 *
 * Not here: the communicator, where slices live, the optimizer, sequence parallelism, GPU
 * code.
 */
#ifndef ZINF_TRAIN_GPT_TP_H
#define ZINF_TRAIN_GPT_TP_H

#include <stddef.h>

#include "train/gpt.h"

/* buf (count) = its sum over the tp ranks, in place; the same bits on every rank. */
typedef int (*gpt_tp_allreduce_fn)(void *ctx, float *buf, size_t count);
/* recv (tp x count) = every rank's send (count), rank-major; the same on every rank. */
typedef int (*gpt_tp_allgather_fn)(void *ctx, const float *send, float *recv, size_t count);

struct gpt_tp_comm {
    int tp, rank;
    gpt_tp_allreduce_fn allreduce;
    gpt_tp_allgather_fn allgather;
    void *ctx; /* passed to both */
};

/* 0 when the model can be cut over tp ranks and rank is one of them, else -EINVAL with a
 * sentence naming the problem in msg (when msg is not NULL): a bad config, tp < 1, rank out
 * of [0, tp), NH not a multiple of tp, V < tp. Every function below answers -EINVAL (0 for
 * the size functions) where this refuses. */
int gpt_tp_validate(const struct gpt_config *cfg, int tp, int rank, char *msg, size_t msg_len);

/* The rows [*lo, *hi) of wte that rank holds. */
int gpt_tp_vocab_range(const struct gpt_config *cfg, int tp, int rank, int *lo, int *hi);

/* shape (rows, cols) of rank's slice of a block slot (enum gpt_block_slot); cols is 1 for
 * vectors. */
int gpt_tp_block_slot_shape(const struct gpt_config *cfg, int tp, int rank, int slot,
                            size_t shape[2]);
/* shape of rank's slice of any tensor of gpt_layout() (the block slots and wte, wpe, lnf). */
int gpt_tp_tensor_shape(const struct gpt_config *cfg, int tp, int rank,
                        const struct gpt_tensor_desc *d, size_t shape[2]);
/* Floats of one block's slices on rank, all 12 slots; 0 where gpt_tp_validate refuses. */
size_t gpt_tp_block_num_params(const struct gpt_config *cfg, int tp, int rank);
/* Point p (or g) at the 12 slices of a contiguous block of gpt_tp_block_num_params() floats,
 * laid out in enum gpt_block_slot order. */
int gpt_tp_block_params_at(const struct gpt_config *cfg, int tp, int rank, const float *block,
                           struct gpt_block_params *p);
int gpt_tp_block_grads_at(const struct gpt_config *cfg, int tp, int rank, float *block,
                          struct gpt_block_grads *g);

/* slice (gpt_tp_tensor_shape) = rank's part of full (d->numel floats), and back: full's
 * elements of rank's part = slice, the rest of full untouched. Initialisation runs
 * gpt_init_tensor on the full tensor and keeps the slice, so every tp starts from the
 * weights of one rank; a checkpoint is re-cut by scattering every old rank's slices into
 * full tensors and slicing those for the new tp. */
int gpt_tp_slice_out(const struct gpt_config *cfg, int tp, int rank,
                     const struct gpt_tensor_desc *d, const float *full, float *slice);
int gpt_tp_slice_in(const struct gpt_config *cfg, int tp, int rank, const struct gpt_tensor_desc *d,
                    const float *slice, float *full);

/* Scratch for every call below on rank (any alignment); 0 where the shape is refused. */
size_t gpt_tp_scratch_bytes(const struct gpt_config *cfg, int tp, int B, int T);

/* Arguments as gpt.h's, p and g holding rank's slices; the comm's tp and rank say which.
 * Tokens are checked against the whole V. */

/* x (B,T,C) = wte[tokens] + wpe[t] on every rank: wte_r is rank's rows (V_r, C), wpe whole;
 * each rank writes the rows of the tokens in its range and zeros elsewhere, then allreduces. */
int gpt_tp_embed_forward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T,
                         const float *wte_r, const float *wpe, const int *tokens, float *x);
/* d_wte_r (V_r, C) += d_x's rows of the tokens in rank's range; d_wpe (maxT, C) += the sum
 * over b of d_x, the same on every rank. No collective. */
int gpt_tp_embed_backward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B,
                          int T, const int *tokens, const float *d_x, float *d_wte_r, float *d_wpe);

/* x_out (B,T,C) = block(x_in), the same on every rank; x_out may be x_in. */
int gpt_tp_block_forward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T,
                         const struct gpt_block_params *p, const float *x_in, float *x_out,
                         struct gpt_scratch *s);
/* Recomputes the block from x_in, then d_in = d_out pulled back (the same on every rank;
 * d_in may be d_out, not x_in) and g += rank's gradient slices. */
int gpt_tp_block_backward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B,
                          int T, const struct gpt_block_params *p, const float *x_in,
                          const float *d_out, float *d_in, struct gpt_block_grads *g,
                          struct gpt_scratch *s);

/* loss as gpt_head_forward's, the same on every rank; wte_r is rank's rows. logits (B,T,V_r)
 * may be NULL: rank's columns of the logits. loss may be NULL (then targets may be too). The
 * row maxima go through the allgather, the sums of exponentials and target logits through
 * one allreduce of 2 B T floats. */
int gpt_tp_head_forward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T,
                        const float *lnf_w, const float *lnf_b, const float *wte_r, const float *x,
                        const int *targets, float *loss, float *logits, struct gpt_scratch *s);
/* d_x (B,T,C), d_lnf_w, d_lnf_b (C): the same on every rank (d_x may be x); d_wte_r
 * (V_r, C) += rank's rows. One more allreduce, of lnf's input gradient (B,T,C). */
int gpt_tp_head_backward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T,
                         const float *lnf_w, const float *lnf_b, const float *wte_r, const float *x,
                         const int *targets, float *d_x, float *d_lnf_w, float *d_lnf_b,
                         float *d_wte_r, float *loss, struct gpt_scratch *s);

#endif
