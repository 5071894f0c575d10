/*
 * moe_int.h - what the files of moe.h share, for them alone: the argument checks and their
 * messages, the row operations that must be the same instructions wherever a token's output
 * or gradient is put together (one rank or a parallel group, for the same bits), and the
 * expert-parallel halves of moe_mlp_forward/backward. moe_route.c holds the config, the
 * gate and the route; moe.c the experts, the whole layer on one rank and the half-block;
 * moe_ep.c the packing and the layer over an expert-parallel group.
 */
#ifndef ZINF_TRAIN_MOE_INT_H
#define ZINF_TRAIN_MOE_INT_H

#include <stddef.h>

#include "train/moe.h"

/* Logs "moe: " and the message, and answers -EINVAL. */
int moe_bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* 0, or the logged -EINVAL of moe_config_validate. */
int moe_check_config(const struct moe_config *cfg);
/* 0 when r was made for cfg's E and k and holds a route of N tokens; else logged -EINVAL. */
int moe_check_route(const struct moe_config *cfg, const struct moe_route *r, int N);
/* 0 when p (or g, when not NULL) points at all four tensors; else logged -EINVAL naming
 * what, the expert's index. */
int moe_check_expert(const struct moe_expert_params *p, const struct moe_expert_grads *g,
                     int index);
/* The scratch's 64-byte aligned start when it holds moe_scratch_bytes(cfg, rows), else
 * NULL (after logging why). */
float *moe_scratch_base(const struct moe_config *cfg, int rows, struct moe_scratch *s);

/* y (C) += w * x (C) and y (C) += x (C): how every token's output and input gradient are
 * summed, in expert order, on one rank and in a group alike. */
void moe_row_axpy(float *y, float w, const float *x, size_t C);
void moe_row_add(float *y, const float *x, size_t C);

/* moe_mlp_forward/backward over an expert-parallel group (moe_ep.c); the arguments are
 * checked by the callers. */
int moe_ep_mlp_forward(const struct moe_config *cfg, const struct moe_ep *ep, int N, const float *x,
                       const struct moe_expert_params *experts, float *y,
                       const struct moe_route *r);
int moe_ep_mlp_backward(const struct moe_config *cfg, const struct moe_ep *ep, int N,
                        const float *x, const struct moe_expert_params *experts,
                        const struct moe_expert_grads *grads, const struct moe_route *r,
                        const float *d_y, float *d_x, float *d_weight);

#endif
