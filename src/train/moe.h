/*
 * moe.h - the math of a mixture-of-experts MLP in the manner of DeepSpeed-MoE (its
 * sharded_moe.py, top-1 and top-2 gating), for the GPT model of gpt.h, on the CPU, in fp32.
 *
 * The layer, for N tokens x (N,C) (the output of a block's ln2):
 *   logits = x @ wg^T, wg (E,C), no bias;  gates = softmax(logits) over the E experts
 *   top-1: each token goes to argmax(gates) (ties: the lowest index)
 *   top-2: and to the argmax of the logits with the first choice masked out
 *   capacity = max(ceil(N / E * k * capacity_factor), min_capacity) slots per expert,
 *     filled in token order; a top-2 token's second choice queues after every first choice
 *     of that expert (DeepSpeed's locations2 += sum(mask1)); choices past the capacity are
 *     dropped (their MoE output is 0: the residual stream carries the token on). Without
 *     drop_tokens the capacity is the largest count of an expert's choices, first and
 *     second together, so nothing is dropped (DeepSpeed's top-2 counts first choices only).
 *   combine weight: top-1 gates[t,e]; top-2 the two gates normalised over the kept ones,
 *     g_i / max(g_1 + g_2, FLT_EPSILON) with a dropped choice's g counted as 0, as DeepSpeed
 *     masks before it normalises (norm_before_drop normalises over both choices instead,
 *     fairseq's normalize_gate_prob_before_dropping)
 *   y[t] = sum over t's kept choices of weight * expert(x[t]), each expert GPT's MLP:
 *     proj(gelu(fc(x))), fc (4C,C)+(4C), proj (C,4C)+(C), GELU's tanh approximation
 *   l_aux = E * sum_e mean_t(gates[t,e]) * (fraction of tokens whose first choice is e);
 *     the trainer adds aux_coef * l_aux to its loss (DeepSpeed's default 0.01) and hands
 *     d_l_aux = aux_coef * dloss back to the backward.
 * Selection and capacity are piecewise constant: the gradient flows through the weights and
 * l_aux into the softmax, never through the choice itself.
 *
 * Deliberately left out, so that the layer is a function of its input: DeepSpeed's noisy
 * gate policies (Jitter, RSample, the Gumbel noise its top-2 adds to the logits before the
 * second choice) and its random token selection (use_rts). Ties go to the lowest index.
 *
 * The pieces, for a trainer that fetches one expert at a time from NVMe:
 *   moe_gate_forward     the route (struct moe_route) and l_aux, from x and wg
 *   moe_expert_forward   one expert: gather its tokens, run the MLP, y += weight * out
 *   moe_expert_backward  recompute one expert from its tokens; its gradients +=, d_x +=, and
 *                        the gradient of each of its tokens' weights
 *   moe_gate_backward    from those and d_l_aux: d_wg +=, d_x += through the softmax
 * Experts that no token chose need not be fetched (moe_route_experts_used lists the rest).
 * moe_mlp_forward/backward run the whole layer with every expert in memory, on one rank or
 * on an expert-parallel group (struct moe_ep: each rank owns E/ep consecutive experts and
 * the tokens travel by all-to-all); moe_sublock_forward/backward add ln2 and the residual.
 *
 * Determinism: sums run in a fixed order, no atomics; the bits do not depend on the OpenMP
 * thread count, nor on ep: an expert runs on one source rank's tokens at a time, with the
 * same shape and values as on that rank alone, and its outputs are combined in expert order.
 *
 * Not here: where the parameters live (the caller hands pointers in), the optimizer, the
 * communicator (the caller's alltoall callback), the attention half of a block, any GPU code.
 */
#ifndef ZINF_TRAIN_MOE_H
#define ZINF_TRAIN_MOE_H

#include <stddef.h>
#include <stdint.h>

#define MOE_MAX_C (1 << 16)      /* channels */
#define MOE_MAX_E 4096           /* experts */
#define MOE_MAX_TOKENS (1 << 24) /* tokens of one call: counts travel as exact floats */
#define MOE_DENOM_EPS 1.1920928955078125e-07f /* torch.finfo(torch.float32).eps */

struct moe_config {
    int C;                 /* channels of the model */
    int E;                 /* experts */
    int k;                 /* experts per token: 1 or 2 */
    float capacity_factor; /* > 0; DeepSpeed's default 1.0 */
    int min_capacity;      /* >= 0; DeepSpeed's default 4 */
    int drop_tokens;       /* drop choices past the capacity (DeepSpeed's default) */
    int norm_before_drop;  /* top-2: normalise the weights before dropping */
};

/* k = 1, capacity_factor 1.0, min_capacity 4, drop_tokens 1, norm_before_drop 0. */
void moe_config_defaults(struct moe_config *cfg, int C, int E);
/* 0, or -EINVAL with a sentence naming the field and its limit written to msg (when msg is
 * not NULL). Every function below checks its config with this and, for any bad argument,
 * logs such a sentence (prefixed "moe: ") and answers -EINVAL. */
int moe_config_validate(const struct moe_config *cfg, char *msg, size_t msg_len);
/* DeepSpeed's dropping capacity for N tokens, ceil(N / E * k * capacity_factor) (in double)
 * but at least min_capacity; -EINVAL for a bad config or N outside [1, MOE_MAX_TOKENS]. */
int moe_capacity(const struct moe_config *cfg, int N);

/* One expert's parameters, or their gradients: GPT's MLP. */
struct moe_expert_params {
    const float *fc_w;   /* (4C,C) */
    const float *fc_b;   /* (4C) */
    const float *proj_w; /* (C,4C) */
    const float *proj_b; /* (C) */
};
struct moe_expert_grads {
    float *fc_w, *fc_b, *proj_w, *proj_b;
};
/* Floats of one expert: 8 C^2 + 5 C. Its tensors, contiguous, in the order above. */
size_t moe_expert_num_params(int C);
void moe_expert_params_at(int C, const float *base, struct moe_expert_params *p);
void moe_expert_grads_at(int C, float *base, struct moe_expert_grads *g);

/* One kept choice in an expert's capacity. */
struct moe_slot {
    int token;  /* row of x */
    int choice; /* 0 = first choice, 1 = second */
};

/* The gate's decisions for N tokens, and what the backward needs from the forward. Made by
 * moe_route_init for up to max_N tokens (its arrays are allocated there), filled by
 * moe_gate_forward, read by everything else; moe_route_release frees it. */
struct moe_route {
    int max_N;    /* tokens the arrays hold */
    int N, E, k;  /* of the last moe_gate_forward */
    int capacity; /* slots per expert: min(moe_capacity(), N), or the largest count
                     without drop_tokens (no expert can take more than N) */
    float l_aux;  /* the balancing loss */
    int dropped;  /* (token, choice) pairs dropped, over all experts */
    int norm_before_drop;
    float *logits;          /* (N,E) x @ wg^T */
    float *gates;           /* (N,E) softmax of the logits */
    float *ce;              /* (E) fraction of tokens whose first choice is e (l_aux's backward) */
    int *expert;            /* (N,k) the chosen experts, first choice first */
    int *slot;              /* (N,k) the slot in the expert's capacity, -1 when dropped */
    float *weight;          /* (N,k) the combine weight, 0 when dropped */
    int *count;             /* (E) kept choices per expert: slots 0..count-1 are used */
    int *wanted;            /* (E) choices per expert before dropping */
    struct moe_slot *slots; /* (E,max_N): expert e's slot s at slots[e * max_N + s] */
};

int moe_route_init(struct moe_route *r, const struct moe_config *cfg, int max_N);
/* Frees what moe_route_init made; a zeroed or half-made route is fine, and so is twice. */
void moe_route_release(struct moe_route *r);
/* The experts with at least one kept token (what must be fetched), written in increasing
 * order to list (E ints; may be NULL); returns their number, or -EINVAL. */
int moe_route_experts_used(const struct moe_route *r, int *list);

/* Scratch of the per-expert functions for up to rows tokens of one expert (rows <= N
 * suffices for a route of N tokens), and of moe_gate_backward for N tokens: 0 when cfg is
 * bad. Any alignment will do; the content does not survive between calls. */
struct moe_scratch {
    void *mem;
    size_t bytes;
};
size_t moe_scratch_bytes(const struct moe_config *cfg, int rows);

/* The gate over x (N,C) with wg (E,C) into r (made for at least N tokens). */
int moe_gate_forward(const struct moe_config *cfg, int N, const float *x, const float *wg,
                     struct moe_route *r);
/* From d_weight (N,k) (dloss/dweight, 0 where dropped) and d_l_aux: d_wg (E,C) += dloss/dwg
 * and d_x (N,C) += dloss/dx through the softmax. */
int moe_gate_backward(const struct moe_config *cfg, const struct moe_route *r, const float *x,
                      const float *wg, const float *d_weight, float d_l_aux, float *d_x,
                      float *d_wg, struct moe_scratch *s);
/* The two halves of each, for a caller that computes the GEMMs elsewhere (a GPU): the
 * gate's decisions are taken on the host from logits that came from anywhere, so that every
 * backend routes alike. moe_route_logits: moe_gate_forward after its GEMM, from the logits
 * (N,E) already in r->logits (moe_route_check_logits: its checks, 0 or logged -EINVAL);
 * moe_gate_dlogits: moe_gate_backward before its GEMMs, d_logits (N,E) = dloss/dlogits
 * (written), after which d_wg += d_logits^T @ x and d_x += d_logits @ wg. */
int moe_route_check_logits(const struct moe_config *cfg, int N, const struct moe_route *r);
int moe_route_logits(const struct moe_config *cfg, int N, struct moe_route *r);
int moe_gate_dlogits(const struct moe_config *cfg, const struct moe_route *r,
                     const float *d_weight, float d_l_aux, float *d_logits);

/* Expert e of the route: y (N,C) += weight * expert(x[token]) for each token it kept; does
 * nothing when it kept none. */
int moe_expert_forward(const struct moe_config *cfg, const struct moe_route *r, int e,
                       const struct moe_expert_params *p, const float *x, float *y,
                       struct moe_scratch *s);
/* Recomputes expert e from x; with d_y (N,C) = dloss/dy: g += its parameter gradients,
 * d_x (N,C) += the gradient through it, and d_weight[t*k + choice] = dloss/dweight for
 * each of its kept (t, choice) (others untouched). */
int moe_expert_backward(const struct moe_config *cfg, const struct moe_route *r, int e,
                        const struct moe_expert_params *p, const struct moe_expert_grads *g,
                        const float *x, const float *d_y, float *d_x, float *d_weight,
                        struct moe_scratch *s);

/* The same on rows already packed, n of them (the owner of an expert in a parallel group
 * runs these on each source rank's rows): out (n,C) = expert(in (n,C)); and, given
 * d_y (n,C) and the weights w (n): g +=, d_in (n,C) = the gradient of in, d_w (n). */
int moe_expert_forward_rows(const struct moe_config *cfg, const struct moe_expert_params *p, int n,
                            const float *in, float *out, struct moe_scratch *s);
int moe_expert_backward_rows(const struct moe_config *cfg, const struct moe_expert_params *p,
                             const struct moe_expert_grads *g, int n, const float *in,
                             const float *d_y, const float *w, float *d_in, float *d_w,
                             struct moe_scratch *s);

/* An all-to-all over the expert-parallel group: send holds ep blocks of count floats, block
 * d for rank d; recv (ep blocks) receives block s from rank s. 0 or -errno. */
typedef int (*moe_alltoall_fn)(const float *send, float *recv, size_t count, void *ctx);

/* An expert-parallel group: rank owns experts [rank*E/ep, (rank+1)*E/ep); every rank routes
 * its own tokens (its own capacity), and all ranks call the same functions together. */
struct moe_ep {
    int ep, rank;
    moe_alltoall_fn alltoall;
    void *ctx;
};

/* Expert-parallel packing. A block (for one destination rank) holds its E/ep experts, each
 * block_cap rows of width floats, slot s of local expert j at row j*block_cap + s; rows
 * past an expert's count are zero. Every rank uses the same block_cap (the largest
 * capacity in the group), so every block has the same size. */
size_t moe_ep_block_floats(const struct moe_config *cfg, int ep, int block_cap, int width);
/* send (ep blocks, width C) = the rows x[token] (x (N,C)) of each kept choice. */
int moe_ep_pack(const struct moe_config *cfg, const struct moe_route *r, int ep, int block_cap,
                const float *x, float *send);
/* The inverse for the combine: y (N,C) = sum, in expert order, of weight * the row that came
 * back (recv, ep blocks of width C) for each kept choice; 0 for a token with none. */
int moe_ep_unpack(const struct moe_config *cfg, const struct moe_route *r, int ep, int block_cap,
                  const float *recv, float *y);

/* The exchange in steps, for a caller that fetches each of its experts only when rows came
 * for it (moe_mlp_forward/backward over a group are these steps with every expert in
 * memory). Every rank of the group, with its own route r:
 *   dispatch   the counts, then the rows of its kept choices to their experts' owners
 *              (the backward's: each row's input, output gradient and weight);
 *   rows       for local expert j (0 to E/ep - 1) and source rank src, in source order: the
 *              n rows that came (moe_ep_rows_for: from all sources), and where the expert's
 *              outputs go (the forward: out (n,C); the backward: out = d_in (n,C), d_w (n));
 *   combine    the outputs back, summed per token in expert order into y (the backward:
 *              d_x (N,C) written, d_weight of every kept choice written).
 * Dispatch allocates the buffers (xf) and combine frees them, as does a failure;
 * moe_ep_xfer_release frees what a caller gives up on. 0 or -errno (-EPROTO for counts
 * that came back impossible). */
struct moe_ep_xfer {
    int block_cap;     /* the group's largest capacity: rows per expert and block */
    int w_out, w_back; /* floats per row of the blocks out and back */
    int *in_counts;    /* (ep, E/ep): rows from each source for each local expert */
    float *send, *recv, *back;
    size_t bf_out, bf_back; /* floats of one block out, back */
};
struct moe_ep_rows {
    int n;
    const float *in, *d_y, *w; /* d_y, w: the backward's */
    float *out, *d_w;          /* d_w: the backward's */
};
int moe_ep_dispatch_forward(const struct moe_config *cfg, const struct moe_ep *ep,
                            const struct moe_route *r, const float *x, struct moe_ep_xfer *xf);
int moe_ep_dispatch_backward(const struct moe_config *cfg, const struct moe_ep *ep,
                             const struct moe_route *r, const float *x, const float *d_y,
                             struct moe_ep_xfer *xf);
int moe_ep_rows(const struct moe_config *cfg, const struct moe_ep *ep, const struct moe_ep_xfer *xf,
                int src, int j, struct moe_ep_rows *out);
int moe_ep_rows_for(const struct moe_config *cfg, const struct moe_ep *ep,
                    const struct moe_ep_xfer *xf, int j);
int moe_ep_combine_forward(const struct moe_config *cfg, const struct moe_ep *ep,
                           const struct moe_route *r, struct moe_ep_xfer *xf, float *y);
int moe_ep_combine_backward(const struct moe_config *cfg, const struct moe_ep *ep,
                            const struct moe_route *r, struct moe_ep_xfer *xf, float *d_x,
                            float *d_weight);
void moe_ep_xfer_release(struct moe_ep_xfer *xf);

/* The same exchange for a caller that moves the rows itself (a GPU gathers and sums them
 * in its own memory, and the host buffers of xf are the staging of the all-to-all):
 *   begin      the counts and the buffers, as dispatch (backward: the three planes);
 *   send_map   where each kept choice's row of plane (0: x, 1: d_y) goes in send: for the
 *              i-th of them, in expert then slot order, off[i] (floats into send) and tok[i]
 *              (the row of x or d_y); their number returned (off, tok: N x k room);
 *   send_weights  the backward's weight plane of send, from the route;
 *   exchange   the all-to-all of send (out) or of what goes back (back: the forward's
 *              send, the backward's back) into recv (a failure releases xf);
 *   combine_map   for token t, off[t*k + j] (floats into recv after the exchange back) of
 *              its j-th row in expert order, -1 past its last, and w (may be NULL) its
 *              weight: y[t] = sum over j in order of w * row, as combine_forward sums;
 *   combine_weights  the backward's d_weight of every kept choice, from recv.
 * moe_ep_rows and moe_ep_rows_for read the blocks of recv, send and back as before. */
int moe_ep_begin(const struct moe_config *cfg, const struct moe_ep *ep, const struct moe_route *r,
                 int backward, struct moe_ep_xfer *xf);
int moe_ep_send_map(const struct moe_config *cfg, const struct moe_ep *ep,
                    const struct moe_route *r, const struct moe_ep_xfer *xf, int plane,
                    int64_t *off, int *tok);
void moe_ep_send_weights(const struct moe_config *cfg, const struct moe_ep *ep,
                         const struct moe_route *r, struct moe_ep_xfer *xf);
int moe_ep_exchange(const struct moe_ep *ep, struct moe_ep_xfer *xf, int back);
void moe_ep_combine_map(const struct moe_config *cfg, const struct moe_ep *ep,
                        const struct moe_route *r, const struct moe_ep_xfer *xf, int64_t *off,
                        float *w);
void moe_ep_combine_weights(const struct moe_config *cfg, const struct moe_ep *ep,
                            const struct moe_route *r, const struct moe_ep_xfer *xf,
                            float *d_weight);

/* The whole layer: the gate into r, then y (N,C) = the MoE output. ep NULL: one rank with
 * all E experts in experts[]; otherwise experts[] holds the E/ep this rank owns, and every
 * rank of the group calls with its own tokens. They allocate their own working memory
 * (-ENOMEM when that fails); an alltoall failure is passed up. */
int moe_mlp_forward(const struct moe_config *cfg, const struct moe_ep *ep, int N, const float *x,
                    const float *wg, const struct moe_expert_params *experts, float *y,
                    struct moe_route *r);
/* From r (as moe_mlp_forward left it for this x and wg, or a fresh moe_gate_forward), d_y
 * (N,C) and d_l_aux: d_x (N,C) = dloss/dx (written, not added), d_wg (E,C) += and
 * grads[] (as experts[]) += the parameter gradients. */
int moe_mlp_backward(const struct moe_config *cfg, const struct moe_ep *ep, int N, const float *x,
                     const float *wg, const struct moe_expert_params *experts,
                     const struct moe_expert_grads *grads, const struct moe_route *r,
                     const float *d_y, float d_l_aux, float *d_x, float *d_wg);

/* The second half of a MoE transformer block, x_out = x2 + moe(ln2(x2)) for the residual
 * stream x2 (N,C) after the attention; ln2_w, ln2_b (C). x_out may be x2. The backward
 * recomputes ln2 and the route from x2, then d_x2 (N,C) = d_out pulled back through the
 * half-block (d_x2 may be d_out), d_ln2_w, d_ln2_b, d_wg and grads +=. l_aux may be NULL.
 *
 * The first half, x2 = x + attn_proj(attention(qkv(ln1(x)))), is inside gpt.c's block
 * functions and not exposed alone. A MoE block needs it as a pair like the two halves of
 * gpt_block_forward/backward: the forward from x to x2 (the same ops in the same order,
 * so a dense block stays bit-equal), and the backward from d_x2 to d_x with the attention
 * and ln1 gradients accumulated, recomputing from x. The trainer keeps x per block, as
 * now, and recomputes x2 in the backward; it adds aux_coef * l_aux of every MoE block to
 * its loss. */
int moe_sublock_forward(const struct moe_config *cfg, const struct moe_ep *ep, int N,
                        const float *x2, const float *ln2_w, const float *ln2_b, const float *wg,
                        const struct moe_expert_params *experts, float *x_out, float *l_aux);
int moe_sublock_backward(const struct moe_config *cfg, const struct moe_ep *ep, int N,
                         const float *x2, const float *ln2_w, const float *ln2_b, const float *wg,
                         const struct moe_expert_params *experts, const float *d_out, float d_l_aux,
                         float *d_x2, float *d_ln2_w, float *d_ln2_b, float *d_wg,
                         const struct moe_expert_grads *grads);

#endif
