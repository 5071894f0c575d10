/*
 * gpt_sp.h - the math of DeepSpeed-Ulysses sequence parallelism for the GPT model of gpt.h:
 * one rank's share of the embedding, a transformer block and the head when the sequence
 * is split across sp ranks by position.
 *
 * Rank r of sp holds positions [r*T/sp, (r+1)*T/sp) of every sequence of the batch: its
 * residual stream is (B, T/sp, C), T being the whole sequence length. Everything that
 * works position by position (the LayerNorms, the qkv and projection linears, the MLP, the
 * residual adds, the embedding, the head) runs on the local positions with the full,
 * replicated weights. Attention needs every position, so inside a block:
 *   qkv (B,T/sp,3C), all heads  --all-to-all-->  qkv (B,T,3C/sp) of the rank's NH/sp heads
 *   causal attention of those heads over the whole sequence  ->  y (B,T,C/sp)
 *   y (B,T,C/sp)  --all-to-all-->  y (B,T/sp,C), all heads, the local positions
 * Rank r owns heads [r*NH/sp, (r+1)*NH/sp), i.e. columns [r*C/sp, (r+1)*C/sp) of each of
 * q, k, v and y. The backward recomputes the block from its input (activation
 * checkpointing, as gpt_block_backward), which takes the forward's two all-to-alls, then
 * runs the backward's two in reverse order: four per block backward, two per forward.
 * Every rank must make the same calls in the same order (each call's exchanges are
 * collective over the sp ranks).
 *
 * The exchange is the caller's: a gpt_sp_alltoall_fn over the sp ranks (the trainer
 * passes its communicator's alltoall). It sends sp blocks of count floats and receives sp
 * blocks of count floats: rank r's received block j is rank j's sent block r. With sp == 1
 * the callback may be NULL (the one exchange is then a local copy); with sp > 1 it may not.
 *
 * Gradients. The input gradients (d_in of a block, d_x of the head) are this rank's rows of
 * the one-rank gradient, as the forward's outputs are its rows of the one-rank output: each
 * position runs the one-rank arithmetic, so they are bitwise where the GEMMs give an
 * element the same bits for B*T/sp rows as for B*T (some of OpenBLAS's kernels do, others
 * not: tests/test_gpt_sp.c asks), and within rounding otherwise (so is the head's d_x for
 * sp not a power of two, whose 1/sp scale rounds; see gpt_sp_head_backward). The parameter
 * gradients are partial: each rank accumulates the sum over its own positions. The caller
 * sums them over the sp ranks (an allreduce in rank order); that sum equals the one-rank
 * gradient up to float reassociation, not bitwise: one rank sums over all B*T rows in one
 * GEMM or column sum, the ranks over B*T/sp rows each and then across ranks. The head's
 * loss is partial the same way: this rank's sum of per-position losses divided by B*T, so
 * the sum over ranks is the mean over the batch.
 *
 * Determinism: the results depend only on (config, sp, rank, B, T) and the values, never
 * on the thread count or timing (the ops are deterministic per shape, the exchanges are
 * copies). With sp == 1 every function gives the bits of its gpt.h twin.
 *
 * Errors: -EINVAL for T % sp != 0, NH % sp != 0, rank outside [0, sp), the checks of gpt.h
 * (B, T, maxT, tokens, NULL pointers) and scratch smaller than gpt_sp_scratch_bytes(); the
 * reason is logged (log_error) and gpt_sp_check() writes it for a caller that wants it. A
 * negative answer of the alltoall callback is returned as it came; the outputs are then
 * undefined (and the other ranks are the communicator's concern).
 *
 * Not here: the communicator, where tensors live, the allreduce of gradients over the sp
 * ranks, any GPU code, and attention split by anything other than whole heads.
 */
#ifndef ZINF_TRAIN_GPT_SP_H
#define ZINF_TRAIN_GPT_SP_H

#include <stddef.h>

#include "train/gpt.h"

/* Sends sp blocks of count floats from send and receives sp blocks of count floats into
 * recv (send and recv do not overlap): block j of recv is block r of rank j's send, r being
 * the calling rank. 0 on success, a negative errno otherwise. */
typedef int (*gpt_sp_alltoall_fn)(void *ctx, const float *send, float *recv, size_t count);

/* 0 when (cfg, sp, rank, B, T) can be run (T is the whole sequence length), or -EINVAL
 * with a sentence naming the problem written to msg (when msg is not NULL). */
int gpt_sp_check(const struct gpt_config *cfg, int sp, int rank, int B, int T, char *msg,
                 size_t msg_len);

/* Bytes of scratch for every call below at (cfg, sp, B, T); 0 for a bad shape. Allocate it
 * once for the largest (B,T); any alignment will do; its content does not survive calls. */
size_t gpt_sp_scratch_bytes(const struct gpt_config *cfg, int sp, int B, int T);

/* x (B,T/sp,C) = wte[tokens] + wpe[position], tokens (B,T/sp) being this rank's slice of
 * the batch's tokens (positions rank*T/sp.. of each sequence). */
int gpt_sp_embed_forward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                         const float *wte, const float *wpe, const int *tokens, float *x);
/* d_wte (V,C) += d_x (B,T/sp,C) scattered by token; d_wpe (maxT,C) += d_x summed over b, in
 * the rows of this rank's positions only (the others are left as they are). */
int gpt_sp_embed_backward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                          const int *tokens, const float *d_x, float *d_wte, float *d_wpe);

/* x_out (B,T/sp,C) = block(x_in (B,T/sp,C)), the whole block p's weights on every rank.
 * x_out may be x_in. Calls alltoall twice. */
int gpt_sp_block_forward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                         const struct gpt_block_params *p, const float *x_in, float *x_out,
                         struct gpt_scratch *s, gpt_sp_alltoall_fn alltoall, void *ctx);
/* Recomputes the block from x_in (B,T/sp,C), then d_in (B,T/sp,C) = d_out (B,T/sp,C) pulled
 * back through the block, and g += this rank's share of the parameter gradients. d_in may
 * be d_out, not x_in. Calls alltoall four times. */
int gpt_sp_block_backward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                          const struct gpt_block_params *p, const float *x_in, const float *d_out,
                          float *d_in, struct gpt_block_grads *g, struct gpt_scratch *s,
                          gpt_sp_alltoall_fn alltoall, void *ctx);

/* loss = sum over the local (b,t) of -log softmax(lnf(x) @ wte^T)[targets], divided by B*T:
 * this rank's share of the batch mean. x (B,T/sp,C), targets (B,T/sp). logits (B,T/sp,V)
 * may be NULL; loss may be NULL (then targets are not read). */
int gpt_sp_head_forward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                        const float *lnf_w, const float *lnf_b, const float *wte, const float *x,
                        const int *targets, float *loss, float *logits, struct gpt_scratch *s);
/* d_x (B,T/sp,C) = d(mean loss over the whole batch)/dx for the local rows (d_x may be x);
 * d_lnf_w, d_lnf_b (C) and d_wte (V,C) += this rank's share. loss (may be NULL) receives
 * the forward's partial value. */
int gpt_sp_head_backward(const struct gpt_config *cfg, int sp, int rank, int B, int T,
                         const float *lnf_w, const float *lnf_b, const float *wte, const float *x,
                         const int *targets, float *d_x, float *d_lnf_w, float *d_lnf_b,
                         float *d_wte, float *loss, struct gpt_scratch *s);

#endif
