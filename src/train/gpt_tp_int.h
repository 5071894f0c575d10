/*
 * gpt_tp_int.h - what the files of gpt_tp.h share, for them alone: the checks every call
 * makes and the carving of scratch. gpt_tp.c holds the cut of the tensors and the block;
 * gpt_tp_vocab.c the vocab-parallel embedding and head.
 */
#ifndef ZINF_TRAIN_GPT_TP_INT_H
#define ZINF_TRAIN_GPT_TP_INT_H

#include <stddef.h>

#include "train/gpt.h"
#include "train/gpt_tp.h"

#define GPT_TP_ALIGN_FLOATS 16 /* sub-buffers of scratch start on 64-byte boundaries */
#define GPT_TP_SCRATCH_ALIGN_BYTES 64

/* 0 when (cfg, comm, B, T) can run: gpt_tp_validate, B, T in range, collectives present
 * where tp > 1; else -EINVAL. */
int gpt_tp_check_call(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T);
/* 0 when every token is in [0, V), else -EINVAL. */
int gpt_tp_check_tokens(const int *tok, size_t N, int V);
/* The next n floats at *off from base (NULL while only sizing), rounded up to 64 bytes. */
float *gpt_tp_take(float *base, size_t *off, size_t n);
/* buf (count) = its sum over the ranks by the comm's allreduce; nothing to do at tp == 1.
 * 0 or the callback's negative return. */
int gpt_tp_allreduce(const struct gpt_tp_comm *c, float *buf, size_t count);
/* Floats of the head's scratch (gpt_tp_vocab.c carves it). */
size_t gpt_tp_head_scratch_floats(const struct gpt_config *cfg, int tp, int B, int T);
/* The 64-byte aligned start of s, or NULL when s is missing or smaller than
 * gpt_tp_scratch_bytes(cfg, tp, B, T). */
float *gpt_tp_scratch_base(const struct gpt_config *cfg, int tp, int B, int T,
                           struct gpt_scratch *s);

#endif
