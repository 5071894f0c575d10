/*
 * moe_ep.c - the MoE layer of moe.h over an expert-parallel group: ep ranks, each owning
 * E/ep consecutive experts, each routing its own tokens with its own gate copy. The tokens
 * travel by the caller's all-to-all, in blocks of one size for every pair of ranks:
 *   1. counts   each rank tells each other its capacity and how many of its tokens each of
 *               that rank's experts kept; the block capacity is the group's largest;
 *   2. dispatch the rows of the kept tokens (moe_ep_pack), E/ep * block capacity per block;
 *   3. the owner runs each expert on each source's rows apart, in source order, with the
 *      shape that source would have used alone (so the bits are those of one rank);
 *   4. combine  the outputs go back the way they came, and each token sums its experts'
 *               weighted outputs in expert order (moe_ep_unpack), as moe.c does.
 * The backward sends each kept token's input row, its output gradient and its weight, and
 * gets back its input gradient and the gradient of its weight; an owner adds its experts'
 * parameter gradients source by source, in rank order.
 *
 * Every rank of the group must call with the same config and ep; one that refuses its
 * arguments never reaches the exchange, and the communicator's deadline must end the rest.
 * Counts that come back impossible (not whole, negative, over the capacity) answer -EPROTO.
 *
 * Not here: the communicator itself, the gate and the route (moe_route.c), the experts'
 * arithmetic (moe.c).
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "train/moe.h"
#include "train/moe_int.h"

/* ---- packing ------------------------------------------------------------------------------ */

size_t moe_ep_block_floats(const struct moe_config *cfg, int ep, int block_cap, int width)
{
    if (moe_config_validate(cfg, NULL, 0) < 0 || ep < 1 || cfg->E % ep != 0 || block_cap < 0 ||
        width < 1)
        return 0;
    return (size_t)(cfg->E / ep) * (size_t)block_cap * (size_t)width;
}

static int check_pack(const struct moe_config *cfg, const struct moe_route *r, int ep,
                      int block_cap)
{
    int rc = moe_check_config(cfg);
    if (rc < 0) return rc;
    if (!r || r->N < 1) return moe_bad("no route (run moe_gate_forward first)");
    if ((rc = moe_check_route(cfg, r, r->N)) < 0) return rc;
    if (ep < 1 || cfg->E % ep != 0)
        return moe_bad("ep=%d ranks cannot share E=%d experts: ep must divide E", ep, cfg->E);
    if (block_cap < r->capacity || block_cap > MOE_MAX_TOKENS)
        return moe_bad("block capacity %d is out of range: it must be in [%d, %d]", block_cap,
                       r->capacity, MOE_MAX_TOKENS);
    return 0;
}

/* Where local expert j's rows of width floats start in the block for rank d. */
static size_t block_at(const struct moe_config *cfg, int ep, int block_cap, int width, int d, int j)
{
    size_t cap = (size_t)block_cap, w = (size_t)width;
    return (size_t)d * moe_ep_block_floats(cfg, ep, block_cap, width) + (size_t)j * cap * w;
}

static void pack(const struct moe_config *cfg, const struct moe_route *r, int ep, int block_cap,
                 const float *x, float *send)
{
    const size_t C = (size_t)cfg->C;
    const int Epr = cfg->E / ep;
    memset(send, 0, (size_t)ep * moe_ep_block_floats(cfg, ep, block_cap, cfg->C) * sizeof(float));
    for (int e = 0; e < cfg->E; e++) {
        float *blk = send + block_at(cfg, ep, block_cap, cfg->C, e / Epr, e % Epr);
        const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
        for (int s = 0; s < r->count[e]; s++)
            memcpy(blk + (size_t)s * C, x + (size_t)sl[s].token * C, C * sizeof(float));
    }
}

static void unpack(const struct moe_config *cfg, const struct moe_route *r, int ep, int block_cap,
                   const float *recv, float *y)
{
    const size_t C = (size_t)cfg->C, k = (size_t)r->k;
    const int Epr = cfg->E / ep;
    memset(y, 0, (size_t)r->N * C * sizeof(float));
    for (int e = 0; e < cfg->E; e++) {
        const float *blk = recv + block_at(cfg, ep, block_cap, cfg->C, e / Epr, e % Epr);
        const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
        for (int s = 0; s < r->count[e]; s++) {
            size_t t = (size_t)sl[s].token;
            moe_row_axpy(y + t * C, r->weight[t * k + (size_t)sl[s].choice], blk + (size_t)s * C,
                         C);
        }
    }
}

int moe_ep_pack(const struct moe_config *cfg, const struct moe_route *r, int ep, int block_cap,
                const float *x, float *send)
{
    int rc = check_pack(cfg, r, ep, block_cap);
    if (rc < 0) return rc;
    if (!x || !send) return moe_bad("ep pack: x or send is NULL");
    pack(cfg, r, ep, block_cap, x, send);
    return 0;
}

int moe_ep_unpack(const struct moe_config *cfg, const struct moe_route *r, int ep, int block_cap,
                  const float *recv, float *y)
{
    int rc = check_pack(cfg, r, ep, block_cap);
    if (rc < 0) return rc;
    if (!recv || !y) return moe_bad("ep unpack: recv or y is NULL");
    unpack(cfg, r, ep, block_cap, recv, y);
    return 0;
}

/* ---- the exchange of counts ----------------------------------------------------------------- */

/* A count that came over the wire: a whole number in [0, max]. */
static int whole(float v, int max)
{
    return v >= 0.0f && v <= (float)max && v == floorf(v);
}

/* Step 1: *block_cap = the group's largest capacity; in_counts (ep, E/ep) = how many rows
 * each source rank sends each of this rank's experts. */
static int exchange_counts(const struct moe_config *cfg, const struct moe_ep *ep,
                           const struct moe_route *r, int *block_cap, int *in_counts)
{
    const int P = ep->ep, Epr = cfg->E / P;
    const size_t hb = 1 + (size_t)Epr;
    float *send = calloc(2 * (size_t)P * hb, sizeof(float));
    if (!send) return -ENOMEM;
    float *recv = send + (size_t)P * hb;
    for (int d = 0; d < P; d++) {
        send[(size_t)d * hb] = (float)r->capacity;
        for (int j = 0; j < Epr; j++)
            send[(size_t)d * hb + 1 + (size_t)j] = (float)r->count[d * Epr + j];
    }
    int rc = ep->alltoall(send, recv, hb, ep->ctx);
    if (rc < 0) goto out;
    int cap = 0;
    for (int s = 0; s < P && rc == 0; s++) {
        const float *h = recv + (size_t)s * hb;
        if (!whole(h[0], MOE_MAX_TOKENS) || h[0] < 1.0f) {
            log_error("moe: rank %d sent capacity %g, not a count in [1, %d]", s, (double)h[0],
                      MOE_MAX_TOKENS);
            rc = -EPROTO;
            break;
        }
        int c = (int)h[0];
        cap = c > cap ? c : cap;
        for (int j = 0; j < Epr; j++) {
            if (!whole(h[1 + j], c)) {
                log_error("moe: rank %d sent %g tokens for expert %d, not a count in [0, %d]", s,
                          (double)h[1 + j], ep->rank * Epr + j, c);
                rc = -EPROTO;
                break;
            }
            in_counts[s * Epr + j] = (int)h[1 + j];
        }
    }
    *block_cap = cap;
out:
    free(send);
    return rc;
}

/* ---- the exchange in steps ------------------------------------------------------------------- */

void moe_ep_xfer_release(struct moe_ep_xfer *xf)
{
    free(xf->in_counts);
    free(xf->send);
    free(xf->recv);
    free(xf->back);
    *xf = (struct moe_ep_xfer){0};
}

/* Counts, then buffers of ep blocks of the widths out (what goes to the owners) and back. */
static int xfer_begin(const struct moe_config *cfg, const struct moe_ep *ep,
                      const struct moe_route *r, int w_out, int w_back, struct moe_ep_xfer *xf)
{
    const int P = ep->ep, Epr = cfg->E / P;
    *xf = (struct moe_ep_xfer){0};
    int rc = check_pack(cfg, r, P, r->capacity);
    if (rc < 0) return rc;
    if (!ep->alltoall || ep->rank < 0 || ep->rank >= P)
        return moe_bad("ep rank %d of %d, or no alltoall", ep->rank, P);
    if (!(xf->in_counts = malloc((size_t)P * (size_t)Epr * sizeof(int)))) return -ENOMEM;
    if ((rc = exchange_counts(cfg, ep, r, &xf->block_cap, xf->in_counts)) < 0) goto fail;
    xf->bf_out = moe_ep_block_floats(cfg, P, xf->block_cap, w_out);
    xf->bf_back = moe_ep_block_floats(cfg, P, xf->block_cap, w_back);
    xf->w_out = w_out;
    xf->w_back = w_back;
    xf->send = calloc(MAX((size_t)P * xf->bf_out, 1), sizeof(float));
    xf->recv = malloc(MAX((size_t)P * MAX(xf->bf_out, xf->bf_back), 1) * sizeof(float));
    xf->back = calloc(MAX((size_t)P * xf->bf_back, 1), sizeof(float));
    if (xf->send && xf->recv && xf->back) return 0;
    rc = -ENOMEM;
fail:
    moe_ep_xfer_release(xf);
    return rc;
}

int moe_ep_dispatch_forward(const struct moe_config *cfg, const struct moe_ep *ep,
                            const struct moe_route *r, const float *x, struct moe_ep_xfer *xf)
{
    int rc = xfer_begin(cfg, ep, r, cfg->C, cfg->C, xf);
    if (rc < 0) return rc;
    pack(cfg, r, ep->ep, xf->block_cap, x, xf->send);
    if ((rc = ep->alltoall(xf->send, xf->recv, xf->bf_out, ep->ctx)) < 0) moe_ep_xfer_release(xf);
    return rc;
}

int moe_ep_dispatch_backward(const struct moe_config *cfg, const struct moe_ep *ep,
                             const struct moe_route *r, const float *x, const float *d_y,
                             struct moe_ep_xfer *xf)
{
    const int C = cfg->C, Epr = cfg->E / MAX(ep->ep, 1), k = r ? r->k : 1;
    int rc = xfer_begin(cfg, ep, r, 2 * C + 1, C + 1, xf);
    if (rc < 0) return rc;
    const size_t cap = (size_t)xf->block_cap, Cz = (size_t)C;
    for (int e = 0; e < cfg->E; e++) {
        float *blk = xf->send + block_at(cfg, ep->ep, xf->block_cap, xf->w_out, e / Epr, e % Epr);
        const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
        for (int i = 0; i < r->count[e]; i++) {
            size_t t = (size_t)sl[i].token;
            memcpy(blk + (size_t)i * Cz, x + t * Cz, Cz * sizeof(float));
            memcpy(blk + (cap + (size_t)i) * Cz, d_y + t * Cz, Cz * sizeof(float));
            blk[2 * cap * Cz + (size_t)i] = r->weight[t * (size_t)k + (size_t)sl[i].choice];
        }
    }
    if ((rc = ep->alltoall(xf->send, xf->recv, xf->bf_out, ep->ctx)) < 0) moe_ep_xfer_release(xf);
    return rc;
}

int moe_ep_rows(const struct moe_config *cfg, const struct moe_ep *ep, const struct moe_ep_xfer *xf,
                int src, int j, struct moe_ep_rows *out)
{
    const int Epr = cfg->E / ep->ep;
    const size_t cap = (size_t)xf->block_cap, C = (size_t)cfg->C;
    const float *in = xf->recv + block_at(cfg, ep->ep, xf->block_cap, xf->w_out, src, j);
    float *ret = (xf->w_out == cfg->C ? xf->send : xf->back) +
                 block_at(cfg, ep->ep, xf->block_cap, xf->w_back, src, j);
    *out = (struct moe_ep_rows){.n = xf->in_counts[src * Epr + j], .in = in, .out = ret};
    if (xf->w_out != cfg->C) { /* the backward's planes */
        out->d_y = in + cap * C;
        out->w = in + 2 * cap * C;
        out->d_w = ret + cap * C;
    }
    return out->n;
}

int moe_ep_rows_for(const struct moe_config *cfg, const struct moe_ep *ep,
                    const struct moe_ep_xfer *xf, int j)
{
    const int Epr = cfg->E / ep->ep;
    int n = 0;
    for (int s = 0; s < ep->ep; s++)
        n += xf->in_counts[s * Epr + j];
    return n;
}

int moe_ep_combine_forward(const struct moe_config *cfg, const struct moe_ep *ep,
                           const struct moe_route *r, struct moe_ep_xfer *xf, float *y)
{
    /* The outputs were written where the inputs came in (moe_ep_rows' out); unused rows are
     * zero. */
    int rc = ep->alltoall(xf->send, xf->recv, xf->bf_out, ep->ctx);
    if (rc == 0) unpack(cfg, r, ep->ep, xf->block_cap, xf->recv, y);
    moe_ep_xfer_release(xf);
    return rc;
}

int moe_ep_combine_backward(const struct moe_config *cfg, const struct moe_ep *ep,
                            const struct moe_route *r, struct moe_ep_xfer *xf, float *d_x,
                            float *d_weight)
{
    const int Epr = cfg->E / ep->ep;
    const size_t cap = (size_t)xf->block_cap, C = (size_t)cfg->C, k = (size_t)r->k;
    int rc = ep->alltoall(xf->back, xf->recv, xf->bf_back, ep->ctx);
    if (rc < 0) goto out;
    memset(d_x, 0, (size_t)r->N * C * sizeof(float));
    for (int e = 0; e < cfg->E; e++) {
        const float *blk =
            xf->recv + block_at(cfg, ep->ep, xf->block_cap, xf->w_back, e / Epr, e % Epr);
        const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
        for (int i = 0; i < r->count[e]; i++) {
            size_t t = (size_t)sl[i].token;
            moe_row_add(d_x + t * C, blk + (size_t)i * C, C);
            d_weight[t * k + (size_t)sl[i].choice] = blk[cap * C + (size_t)i];
        }
    }
out:
    moe_ep_xfer_release(xf);
    return rc;
}

/* ---- the exchange with the rows moved by the caller ------------------------------------------ */

int moe_ep_begin(const struct moe_config *cfg, const struct moe_ep *ep, const struct moe_route *r,
                 int backward, struct moe_ep_xfer *xf)
{
    const int C = cfg->C;
    return backward ? xfer_begin(cfg, ep, r, 2 * C + 1, C + 1, xf) : xfer_begin(cfg, ep, r, C, C, xf);
}

int moe_ep_send_map(const struct moe_config *cfg, const struct moe_ep *ep,
                    const struct moe_route *r, const struct moe_ep_xfer *xf, int plane,
                    int64_t *off, int *tok)
{
    const int Epr = cfg->E / ep->ep;
    const size_t cap = (size_t)xf->block_cap, C = (size_t)cfg->C;
    int n = 0;
    for (int e = 0; e < cfg->E; e++) {
        size_t at = block_at(cfg, ep->ep, xf->block_cap, xf->w_out, e / Epr, e % Epr);
        const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
        for (int i = 0; i < r->count[e]; i++, n++) {
            off[n] = (int64_t)(at + ((size_t)plane * cap + (size_t)i) * C);
            tok[n] = sl[i].token;
        }
    }
    return n;
}

void moe_ep_send_weights(const struct moe_config *cfg, const struct moe_ep *ep,
                         const struct moe_route *r, struct moe_ep_xfer *xf)
{
    const int Epr = cfg->E / ep->ep;
    const size_t cap = (size_t)xf->block_cap, C = (size_t)cfg->C, k = (size_t)r->k;
    for (int e = 0; e < cfg->E; e++) {
        float *blk = xf->send + block_at(cfg, ep->ep, xf->block_cap, xf->w_out, e / Epr, e % Epr);
        const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
        for (int i = 0; i < r->count[e]; i++)
            blk[2 * cap * C + (size_t)i] =
                r->weight[(size_t)sl[i].token * k + (size_t)sl[i].choice];
    }
}

int moe_ep_exchange(const struct moe_ep *ep, struct moe_ep_xfer *xf, int back)
{
    const float *send = back && xf->w_out != xf->w_back ? xf->back : xf->send;
    size_t n = back ? xf->bf_back : xf->bf_out;
    int rc = ep->alltoall(send, xf->recv, n, ep->ctx);
    if (rc < 0) moe_ep_xfer_release(xf);
    return rc;
}

void moe_ep_combine_map(const struct moe_config *cfg, const struct moe_ep *ep,
                        const struct moe_route *r, const struct moe_ep_xfer *xf, int64_t *off,
                        float *w)
{
    const int Epr = cfg->E / ep->ep, k = r->k;
    const size_t C = (size_t)cfg->C;
    for (size_t i = 0; i < (size_t)r->N * (size_t)k; i++) {
        off[i] = -1;
        if (w) w[i] = 0.0f;
    }
    /* Expert order: each token's entries come in the order moe_ep_unpack adds them. */
    for (int e = 0; e < cfg->E; e++) {
        size_t at = block_at(cfg, ep->ep, xf->block_cap, xf->w_back, e / Epr, e % Epr);
        const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
        for (int i = 0; i < r->count[e]; i++) {
            size_t t = (size_t)sl[i].token, j = t * (size_t)k;
            while (off[j] >= 0)
                j++;
            off[j] = (int64_t)(at + (size_t)i * C);
            if (w) w[j] = r->weight[t * (size_t)k + (size_t)sl[i].choice];
        }
    }
}

void moe_ep_combine_weights(const struct moe_config *cfg, const struct moe_ep *ep,
                            const struct moe_route *r, const struct moe_ep_xfer *xf,
                            float *d_weight)
{
    const int Epr = cfg->E / ep->ep;
    const size_t cap = (size_t)xf->block_cap, C = (size_t)cfg->C, k = (size_t)r->k;
    for (int e = 0; e < cfg->E; e++) {
        const float *blk =
            xf->recv + block_at(cfg, ep->ep, xf->block_cap, xf->w_back, e / Epr, e % Epr);
        const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
        for (int i = 0; i < r->count[e]; i++)
            d_weight[(size_t)sl[i].token * k + (size_t)sl[i].choice] = blk[cap * C + (size_t)i];
    }
}

/* ---- forward and backward over the group ---------------------------------------------------- */

int moe_ep_mlp_forward(const struct moe_config *cfg, const struct moe_ep *ep, int N, const float *x,
                       const struct moe_expert_params *experts, float *y, const struct moe_route *r)
{
    (void)N; /* the route's */
    const int P = ep->ep, Epr = cfg->E / P;
    struct moe_ep_xfer xf;
    struct moe_scratch s = {0};
    int rc = moe_ep_dispatch_forward(cfg, ep, r, x, &xf);
    if (rc < 0) return rc;
    s.bytes = moe_scratch_bytes(cfg, xf.block_cap);
    if (!(s.mem = malloc(s.bytes))) rc = -ENOMEM;
    for (int j = 0; j < Epr && rc == 0; j++)
        for (int src = 0; src < P && rc == 0; src++) {
            struct moe_ep_rows rw;
            if (moe_ep_rows(cfg, ep, &xf, src, j, &rw) > 0)
                rc = moe_expert_forward_rows(cfg, &experts[j], rw.n, rw.in, rw.out, &s);
        }
    free(s.mem);
    if (rc < 0) {
        moe_ep_xfer_release(&xf);
        return rc;
    }
    return moe_ep_combine_forward(cfg, ep, r, &xf, y);
}

/* In the backward, a local expert's part of a block to the owner holds three planes of
 * block_cap rows each: the input rows (C), the output gradients (C), the weights (1); of a
 * block back, two: the input gradients (C), the weight gradients (1). */
int moe_ep_mlp_backward(const struct moe_config *cfg, const struct moe_ep *ep, int N,
                        const float *x, const struct moe_expert_params *experts,
                        const struct moe_expert_grads *grads, const struct moe_route *r,
                        const float *d_y, float *d_x, float *d_weight)
{
    (void)N;
    const int P = ep->ep, Epr = cfg->E / P;
    struct moe_ep_xfer xf;
    struct moe_scratch s = {0};
    int rc = moe_ep_dispatch_backward(cfg, ep, r, x, d_y, &xf);
    if (rc < 0) return rc;
    s.bytes = moe_scratch_bytes(cfg, xf.block_cap);
    if (!(s.mem = malloc(s.bytes))) rc = -ENOMEM;
    for (int j = 0; j < Epr && rc == 0; j++)
        for (int src = 0; src < P && rc == 0; src++) {
            struct moe_ep_rows rw;
            if (moe_ep_rows(cfg, ep, &xf, src, j, &rw) > 0)
                rc = moe_expert_backward_rows(cfg, &experts[j], &grads[j], rw.n, rw.in, rw.d_y,
                                              rw.w, rw.out, rw.d_w, &s);
        }
    free(s.mem);
    if (rc < 0) {
        moe_ep_xfer_release(&xf);
        return rc;
    }
    return moe_ep_combine_backward(cfg, ep, r, &xf, d_x, d_weight);
}
