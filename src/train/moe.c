/*
 * moe.c - the experts of moe.h and the layer they make: one expert's forward and backward on
 * packed rows (GPT's MLP from ops.c's layers), the same gathered from and scattered to the
 * tokens of a route, the whole MoE MLP on one rank (or handed to moe_ep.c for a parallel
 * group), and the second half of a MoE block (ln2, the MoE MLP, the residual add).
 *
 * An expert's backward recomputes its forward from its packed input, as gpt.c's block does:
 * nothing of the forward is kept but the route. Every token's output is the sum of its
 * experts' weighted outputs taken in expert order, and its input gradient the sum of its
 * experts' in expert order followed by the gate's; moe_ep.c sums in the same order with the
 * same row operations (moe_int.h), so the two paths give the same bits.
 *
 * Not here: the gate and the route (moe_route.c), the expert-parallel exchange (moe_ep.c),
 * the attention half of the block (gpt.c), where the parameters live.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "train/moe.h"
#include "train/moe_int.h"
#include "train/ops.h"

#define ALIGN_FLOATS 16

/* ---- layout of an expert ----------------------------------------------------------------- */

size_t moe_expert_num_params(int C)
{
    size_t c = C > 0 ? (size_t)C : 0;
    return 8 * c * c + 5 * c;
}

void moe_expert_params_at(int C, const float *base, struct moe_expert_params *p)
{
    size_t c = (size_t)C;
    p->fc_w = base;
    p->fc_b = p->fc_w + 4 * c * c;
    p->proj_w = p->fc_b + 4 * c;
    p->proj_b = p->proj_w + 4 * c * c;
}

void moe_expert_grads_at(int C, float *base, struct moe_expert_grads *g)
{
    size_t c = (size_t)C;
    g->fc_w = base;
    g->fc_b = g->fc_w + 4 * c * c;
    g->proj_w = g->fc_b + 4 * c;
    g->proj_b = g->proj_w + 4 * c * c;
}

/* ---- row operations shared with moe_ep.c ----------------------------------------------- */

void moe_row_axpy(float *y, float w, const float *x, size_t C)
{
    for (size_t c = 0; c < C; c++)
        y[c] += w * x[c];
}

void moe_row_add(float *y, const float *x, size_t C)
{
    for (size_t c = 0; c < C; c++)
        y[c] += x[c];
}

/* ---- one expert on packed rows ------------------------------------------------------------- */

/* The scratch of moe_scratch_bytes() for n rows (the sizes match moe_route.c's count). The
 * rows functions use h..d_o; the token wrappers carve their packed rows (in, io, d_in, w,
 * d_w) from the same scratch. */
struct bufs {
    float *h, *hg, *dh; /* (n,4C): fc output, after the GELU, its gradient */
    float *o, *d_o;     /* (n,C): the recomputed output, dloss/doutput */
    float *in, *io;     /* (n,C): gathered inputs; outputs (forward) or gathered d_y */
    float *d_in;        /* (n,C) */
    float *w, *d_w;     /* (n) */
};

static float *take(float **p, size_t n)
{
    float *r = *p;
    *p += (n + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
    return r;
}

static void carve(struct bufs *b, float *base, size_t n, size_t C)
{
    b->h = take(&base, n * 4 * C);
    b->hg = take(&base, n * 4 * C);
    b->dh = take(&base, n * 4 * C);
    b->o = take(&base, n * C);
    b->d_o = take(&base, n * C);
    b->in = take(&base, n * C);
    b->io = take(&base, n * C);
    b->d_in = take(&base, n * C);
    b->w = take(&base, n);
    b->d_w = take(&base, n);
}

/* out (n,C) = proj(gelu(fc(in))); h and hg kept in b for a backward. */
static void rows_forward(size_t C, const struct moe_expert_params *p, size_t n, const float *in,
                         float *out, const struct bufs *b)
{
    ops_linear_forward(b->h, in, p->fc_w, p->fc_b, NULL, n, C, 4 * C);
    ops_gelu_forward(b->hg, b->h, n * 4 * C);
    ops_linear_forward(out, b->hg, p->proj_w, p->proj_b, NULL, n, 4 * C, C);
}

/* The expert's rows contribute w[i] * out[i] to the output, so dloss/dw[i] = d_y[i] . out[i]
 * and dloss/dout[i] = w[i] * d_y[i]. */
static void rows_backward(size_t C, const struct moe_expert_params *p,
                          const struct moe_expert_grads *g, size_t n, const float *in,
                          const float *d_y, const float *w, float *d_in, float *d_w,
                          const struct bufs *b)
{
    rows_forward(C, p, n, in, b->o, b);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        const float *dy = d_y + i * C, *o = b->o + i * C;
        float *d_o = b->d_o + i * C;
        double dot = 0.0;
        for (size_t c = 0; c < C; c++) {
            dot += (double)dy[c] * o[c];
            d_o[c] = w[i] * dy[c];
        }
        d_w[i] = (float)dot;
    }
    ops_linear_backward(b->dh, g->proj_w, g->proj_b, b->d_o, b->hg, p->proj_w, n, 4 * C, C);
    ops_gelu_backward(b->dh, b->h, n * 4 * C);
    ops_linear_backward(d_in, g->fc_w, g->fc_b, b->dh, in, p->fc_w, n, C, 4 * C);
}

static int check_rows(const struct moe_config *cfg, int n)
{
    int rc = moe_check_config(cfg);
    if (rc < 0) return rc;
    if (n < 0 || n > MOE_MAX_TOKENS)
        return moe_bad("n=%d rows is out of range: it must be in [0, %d]", n, MOE_MAX_TOKENS);
    return 0;
}

int moe_expert_forward_rows(const struct moe_config *cfg, const struct moe_expert_params *p, int n,
                            const float *in, float *out, struct moe_scratch *s)
{
    int rc = check_rows(cfg, n);
    if (rc < 0) return rc;
    if ((rc = moe_check_expert(p, NULL, 0)) < 0) return rc;
    if (!in || !out) return moe_bad("expert forward: in or out is NULL");
    if (n == 0) return 0;
    float *base = moe_scratch_base(cfg, n, s);
    if (!base) return -EINVAL;
    struct bufs b;
    carve(&b, base, (size_t)n, (size_t)cfg->C);
    rows_forward((size_t)cfg->C, p, (size_t)n, in, out, &b);
    return 0;
}

int moe_expert_backward_rows(const struct moe_config *cfg, const struct moe_expert_params *p,
                             const struct moe_expert_grads *g, int n, const float *in,
                             const float *d_y, const float *w, float *d_in, float *d_w,
                             struct moe_scratch *s)
{
    int rc = check_rows(cfg, n);
    if (rc < 0) return rc;
    if ((rc = moe_check_expert(p, g, 0)) < 0) return rc;
    if (!g) return moe_bad("expert backward: no gradients");
    if (!in || !d_y || !w || !d_in || !d_w)
        return moe_bad("expert backward: in, d_y, w, d_in or d_w is NULL");
    if (n == 0) return 0;
    float *base = moe_scratch_base(cfg, n, s);
    if (!base) return -EINVAL;
    struct bufs b;
    carve(&b, base, (size_t)n, (size_t)cfg->C);
    rows_backward((size_t)cfg->C, p, g, (size_t)n, in, d_y, w, d_in, d_w, &b);
    return 0;
}

/* ---- one expert on the tokens of a route ---------------------------------------------------- */

static int check_expert_call(const struct moe_config *cfg, const struct moe_route *r, int e)
{
    int rc = moe_check_config(cfg);
    if (rc < 0) return rc;
    if (!r || r->N < 1) return moe_bad("no route (run moe_gate_forward first)");
    if ((rc = moe_check_route(cfg, r, r->N)) < 0) return rc;
    if (e < 0 || e >= cfg->E) return moe_bad("expert %d is out of range: there are %d", e, cfg->E);
    return 0;
}

static void expert_forward(size_t C, const struct moe_route *r, int e,
                           const struct moe_expert_params *p, const float *x, float *y,
                           const struct bufs *b)
{
    const size_t n = (size_t)r->count[e], k = (size_t)r->k;
    const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
    for (size_t s = 0; s < n; s++)
        memcpy(b->in + s * C, x + (size_t)sl[s].token * C, C * sizeof(float));
    rows_forward(C, p, n, b->in, b->io, b);
    /* An expert holds each token at most once: the rows are distinct. */
#pragma omp parallel for schedule(static)
    for (size_t s = 0; s < n; s++) {
        size_t t = (size_t)sl[s].token;
        moe_row_axpy(y + t * C, r->weight[t * k + (size_t)sl[s].choice], b->io + s * C, C);
    }
}

static void expert_backward(size_t C, const struct moe_route *r, int e,
                            const struct moe_expert_params *p, const struct moe_expert_grads *g,
                            const float *x, const float *d_y, float *d_x, float *d_weight,
                            const struct bufs *b)
{
    const size_t n = (size_t)r->count[e], k = (size_t)r->k;
    const struct moe_slot *sl = r->slots + (size_t)e * (size_t)r->max_N;
    for (size_t s = 0; s < n; s++) {
        size_t t = (size_t)sl[s].token;
        memcpy(b->in + s * C, x + t * C, C * sizeof(float));
        memcpy(b->io + s * C, d_y + t * C, C * sizeof(float));
        b->w[s] = r->weight[t * k + (size_t)sl[s].choice];
    }
    rows_backward(C, p, g, n, b->in, b->io, b->w, b->d_in, b->d_w, b);
#pragma omp parallel for schedule(static)
    for (size_t s = 0; s < n; s++) {
        size_t t = (size_t)sl[s].token;
        moe_row_add(d_x + t * C, b->d_in + s * C, C);
        d_weight[t * k + (size_t)sl[s].choice] = b->d_w[s];
    }
}

int moe_expert_forward(const struct moe_config *cfg, const struct moe_route *r, int e,
                       const struct moe_expert_params *p, const float *x, float *y,
                       struct moe_scratch *s)
{
    int rc = check_expert_call(cfg, r, e);
    if (rc < 0) return rc;
    if ((rc = moe_check_expert(p, NULL, e)) < 0) return rc;
    if (!x || !y) return moe_bad("expert forward: x or y is NULL");
    if (r->count[e] == 0) return 0;
    float *base = moe_scratch_base(cfg, r->count[e], s);
    if (!base) return -EINVAL;
    struct bufs b;
    carve(&b, base, (size_t)r->count[e], (size_t)cfg->C);
    expert_forward((size_t)cfg->C, r, e, p, x, y, &b);
    return 0;
}

int moe_expert_backward(const struct moe_config *cfg, const struct moe_route *r, int e,
                        const struct moe_expert_params *p, const struct moe_expert_grads *g,
                        const float *x, const float *d_y, float *d_x, float *d_weight,
                        struct moe_scratch *s)
{
    int rc = check_expert_call(cfg, r, e);
    if (rc < 0) return rc;
    if (!g) return moe_bad("expert %d backward: no gradients", e);
    if ((rc = moe_check_expert(p, g, e)) < 0) return rc;
    if (!x || !d_y || !d_x || !d_weight)
        return moe_bad("expert backward: x, d_y, d_x or d_weight is NULL");
    if (r->count[e] == 0) return 0;
    float *base = moe_scratch_base(cfg, r->count[e], s);
    if (!base) return -EINVAL;
    struct bufs b;
    carve(&b, base, (size_t)r->count[e], (size_t)cfg->C);
    expert_backward((size_t)cfg->C, r, e, p, g, x, d_y, d_x, d_weight, &b);
    return 0;
}

/* ---- the whole layer --------------------------------------------------------------------- */

/* 0 when ep (NULL: one rank) fits cfg, and the experts (and grads, when not NULL) this rank
 * holds are all there; else logged -EINVAL. */
static int check_layer(const struct moe_config *cfg, const struct moe_ep *ep, int N,
                       const struct moe_expert_params *experts,
                       const struct moe_expert_grads *grads, int want_grads)
{
    int rc = moe_check_config(cfg);
    if (rc < 0) return rc;
    if (N < 1 || N > MOE_MAX_TOKENS)
        return moe_bad("N=%d tokens is out of range: it must be in [1, %d]", N, MOE_MAX_TOKENS);
    int local = cfg->E;
    if (ep) {
        if (ep->ep < 1 || ep->ep > cfg->E || cfg->E % ep->ep != 0)
            return moe_bad("ep=%d ranks cannot share E=%d experts: ep must divide E", ep->ep,
                           cfg->E);
        if (ep->rank < 0 || ep->rank >= ep->ep)
            return moe_bad("rank %d is out of range for ep=%d", ep->rank, ep->ep);
        if (!ep->alltoall) return moe_bad("the expert-parallel group has no alltoall");
        local = cfg->E / ep->ep;
    }
    if (!experts) return moe_bad("no experts");
    if (want_grads && !grads) return moe_bad("no expert gradients");
    for (int j = 0; j < local; j++)
        if ((rc = moe_check_expert(&experts[j], grads ? &grads[j] : NULL, j)) < 0) return rc;
    return 0;
}

/* Scratch for N tokens, or NULL (-ENOMEM in *rc). */
static void *scratch_alloc(const struct moe_config *cfg, int N, struct moe_scratch *s, int *rc)
{
    s->bytes = moe_scratch_bytes(cfg, N);
    s->mem = malloc(s->bytes);
    if (!s->mem) *rc = -ENOMEM;
    return s->mem;
}

int moe_mlp_forward(const struct moe_config *cfg, const struct moe_ep *ep, int N, const float *x,
                    const float *wg, const struct moe_expert_params *experts, float *y,
                    struct moe_route *r)
{
    int rc = check_layer(cfg, ep, N, experts, NULL, 0);
    if (rc < 0) return rc;
    if (!y) return moe_bad("mlp forward: y is NULL");
    if ((rc = moe_gate_forward(cfg, N, x, wg, r)) < 0) return rc;
    if (ep) return moe_ep_mlp_forward(cfg, ep, N, x, experts, y, r);

    struct moe_scratch s;
    if (!scratch_alloc(cfg, N, &s, &rc)) return rc;
    float *base = moe_scratch_base(cfg, N, &s);
    memset(y, 0, (size_t)N * (size_t)cfg->C * sizeof(float));
    for (int e = 0; e < cfg->E; e++) {
        if (!r->count[e]) continue;
        struct bufs b;
        carve(&b, base, (size_t)r->count[e], (size_t)cfg->C);
        expert_forward((size_t)cfg->C, r, e, &experts[e], x, y, &b);
    }
    free(s.mem);
    return 0;
}

int moe_mlp_backward(const struct moe_config *cfg, const struct moe_ep *ep, int N, const float *x,
                     const float *wg, const struct moe_expert_params *experts,
                     const struct moe_expert_grads *grads, const struct moe_route *r,
                     const float *d_y, float d_l_aux, float *d_x, float *d_wg)
{
    int rc = check_layer(cfg, ep, N, experts, grads, 1);
    if (rc < 0) return rc;
    if ((rc = moe_check_route(cfg, r, N)) < 0) return rc;
    if (!x || !wg || !d_y || !d_x || !d_wg)
        return moe_bad("mlp backward: x, wg, d_y, d_x or d_wg is NULL");
    if (!isfinite(d_l_aux))
        return moe_bad("mlp backward: d_l_aux=%g is not finite", (double)d_l_aux);
    struct moe_scratch s;
    if (!scratch_alloc(cfg, N, &s, &rc)) return rc;
    float *d_weight = calloc((size_t)N * (size_t)cfg->k, sizeof(float));
    if (!d_weight) {
        free(s.mem);
        return -ENOMEM;
    }
    if (ep) {
        rc = moe_ep_mlp_backward(cfg, ep, N, x, experts, grads, r, d_y, d_x, d_weight);
    } else {
        float *base = moe_scratch_base(cfg, N, &s);
        memset(d_x, 0, (size_t)N * (size_t)cfg->C * sizeof(float));
        for (int e = 0; e < cfg->E; e++) {
            if (!r->count[e]) continue;
            struct bufs b;
            carve(&b, base, (size_t)r->count[e], (size_t)cfg->C);
            expert_backward((size_t)cfg->C, r, e, &experts[e], &grads[e], x, d_y, d_x, d_weight,
                            &b);
        }
    }
    if (rc == 0) rc = moe_gate_backward(cfg, r, x, wg, d_weight, d_l_aux, d_x, d_wg, &s);
    free(d_weight);
    free(s.mem);
    return rc;
}

/* ---- the second half of a MoE block ---------------------------------------------------------- */

/* ln2 of x2 into one allocation at *mem: ln (N,C), then an (N,C) for the caller (at
 * ln + N*C), then mean and rstd (N). */
static int ln2_forward(const struct moe_config *cfg, int N, const float *x2, const float *w,
                       const float *b, float **mem, float **ln, float **mean, float **rstd)
{
    size_t NC = (size_t)N * (size_t)cfg->C;
    *mem = malloc((2 * NC + 2 * (size_t)N) * sizeof(float));
    if (!*mem) return -ENOMEM;
    *ln = *mem;
    *mean = *ln + 2 * NC;
    *rstd = *mean + N;
    ops_layernorm_forward(*ln, *mean, *rstd, x2, w, b, (size_t)N, (size_t)cfg->C);
    return 0;
}

int moe_sublock_forward(const struct moe_config *cfg, const struct moe_ep *ep, int N,
                        const float *x2, const float *ln2_w, const float *ln2_b, const float *wg,
                        const struct moe_expert_params *experts, float *x_out, float *l_aux)
{
    int rc = check_layer(cfg, ep, N, experts, NULL, 0);
    if (rc < 0) return rc;
    if (!x2 || !ln2_w || !ln2_b || !wg || !x_out)
        return moe_bad("sub-block forward: x2, ln2_w, ln2_b, wg or x_out is NULL");
    struct moe_route r;
    float *mem, *ln, *mean, *rstd, *y;
    if ((rc = moe_route_init(&r, cfg, N)) < 0) return rc;
    if ((rc = ln2_forward(cfg, N, x2, ln2_w, ln2_b, &mem, &ln, &mean, &rstd)) < 0) goto err;
    y = ln + (size_t)N * (size_t)cfg->C; /* the second (N,C) of mem */
    if ((rc = moe_mlp_forward(cfg, ep, N, ln, wg, experts, y, &r)) < 0) goto err_mem;
    ops_add(x_out, x2, y, (size_t)N * (size_t)cfg->C);
    if (l_aux) *l_aux = r.l_aux;
err_mem:
    free(mem);
err:
    moe_route_release(&r);
    return rc;
}

int moe_sublock_backward(const struct moe_config *cfg, const struct moe_ep *ep, int N,
                         const float *x2, const float *ln2_w, const float *ln2_b, const float *wg,
                         const struct moe_expert_params *experts, const float *d_out, float d_l_aux,
                         float *d_x2, float *d_ln2_w, float *d_ln2_b, float *d_wg,
                         const struct moe_expert_grads *grads)
{
    int rc = check_layer(cfg, ep, N, experts, grads, 1);
    if (rc < 0) return rc;
    if (!x2 || !ln2_w || !ln2_b || !wg || !d_out || !d_x2 || !d_ln2_w || !d_ln2_b || !d_wg)
        return moe_bad("sub-block backward: an input or gradient pointer is NULL");
    struct moe_route r;
    float *mem, *ln, *mean, *rstd, *d_ln;
    if ((rc = moe_route_init(&r, cfg, N)) < 0) return rc;
    if ((rc = ln2_forward(cfg, N, x2, ln2_w, ln2_b, &mem, &ln, &mean, &rstd)) < 0) goto err;
    d_ln = ln + (size_t)N * (size_t)cfg->C;
    if ((rc = moe_gate_forward(cfg, N, ln, wg, &r)) < 0) goto err_mem;
    /* d_out is read to the end here, before d_x2 (which may be d_out) is written. */
    rc = moe_mlp_backward(cfg, ep, N, ln, wg, experts, grads, &r, d_out, d_l_aux, d_ln, d_wg);
    if (rc < 0) goto err_mem;
    if (d_x2 != d_out) memcpy(d_x2, d_out, (size_t)N * (size_t)cfg->C * sizeof(float));
    ops_layernorm_backward(d_x2, 1, d_ln2_w, d_ln2_b, d_ln, x2, ln2_w, mean, rstd, (size_t)N,
                           (size_t)cfg->C);
err_mem:
    free(mem);
err:
    moe_route_release(&r);
    return rc;
}
