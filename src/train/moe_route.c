/*
 * moe_route.c - the gate of moe.h: the config and its checks, the capacity, the route (which
 * tokens go to which expert's slots, with which weight), the balancing loss l_aux, and the
 * gate's backward through the weights and l_aux into the softmax, wg and x.
 *
 * The route is built in one sequential pass over the tokens, as DeepSpeed's cumsum over the
 * token axis builds its locations: slots are handed out in token order, so the route is a
 * function of the gates alone. The softmax rows and the backward's rows run on OpenMP
 * threads, each row by one thread; the GEMMs are ops_gemm's, whose bits do not depend on the
 * thread count.
 *
 * Not here: the experts (moe.c), the expert-parallel exchange (moe_ep.c).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "train/moe.h"
#include "train/moe_int.h"
#include "train/ops.h"

#define SCRATCH_ALIGN_BYTES 64
#define ALIGN_FLOATS 16

/* ---- config and checks ------------------------------------------------------------------ */

void moe_config_defaults(struct moe_config *cfg, int C, int E)
{
    *cfg = (struct moe_config){.C = C,
                               .E = E,
                               .k = 1,
                               .capacity_factor = 1.0f,
                               .min_capacity = 4,
                               .drop_tokens = 1,
                               .norm_before_drop = 0};
}

int moe_config_validate(const struct moe_config *cfg, char *msg, size_t msg_len)
{
    char tmp[160];
    if (!msg || !msg_len) {
        msg = tmp;
        msg_len = sizeof(tmp);
    }
    msg[0] = '\0';
    if (!cfg) {
        snprintf(msg, msg_len, "no config");
        return -EINVAL;
    }
    if (cfg->C < 1 || cfg->C > MOE_MAX_C) {
        snprintf(msg, msg_len, "C=%d is out of range: it must be in [1, %d]", cfg->C, MOE_MAX_C);
        return -EINVAL;
    }
    if (cfg->k != 1 && cfg->k != 2) {
        snprintf(msg, msg_len, "k=%d is not supported: top-k gating takes k=1 or k=2", cfg->k);
        return -EINVAL;
    }
    if (cfg->E < cfg->k || cfg->E > MOE_MAX_E) {
        snprintf(msg, msg_len, "E=%d experts is out of range: top-%d needs E in [%d, %d]", cfg->E,
                 cfg->k, cfg->k, MOE_MAX_E);
        return -EINVAL;
    }
    if (!(cfg->capacity_factor > 0.0f) || !isfinite(cfg->capacity_factor)) {
        snprintf(msg, msg_len, "capacity_factor=%g must be a finite number above 0",
                 (double)cfg->capacity_factor);
        return -EINVAL;
    }
    if (cfg->min_capacity < 0 || cfg->min_capacity > MOE_MAX_TOKENS) {
        snprintf(msg, msg_len, "min_capacity=%d is out of range: it must be in [0, %d]",
                 cfg->min_capacity, MOE_MAX_TOKENS);
        return -EINVAL;
    }
    return 0;
}

int moe_bad(const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    log_error("moe: %s", buf);
    return -EINVAL;
}

int moe_check_config(const struct moe_config *cfg)
{
    char msg[160];
    if (moe_config_validate(cfg, msg, sizeof(msg)) < 0) return moe_bad("%s", msg);
    return 0;
}

int moe_check_route(const struct moe_config *cfg, const struct moe_route *r, int N)
{
    if (!r || !r->gates) return moe_bad("no route (make one with moe_route_init)");
    if (r->E != cfg->E || r->k != cfg->k)
        return moe_bad("the route was made for E=%d top-%d, not for this config's E=%d top-%d",
                       r->E, r->k, cfg->E, cfg->k);
    if (r->N != N)
        return moe_bad("the route holds %d tokens, not the %d of this call (run the gate first)",
                       r->N, N);
    return 0;
}

int moe_check_expert(const struct moe_expert_params *p, const struct moe_expert_grads *g, int index)
{
    if (!p || !p->fc_w || !p->fc_b || !p->proj_w || !p->proj_b)
        return moe_bad("expert %d: a parameter pointer is NULL", index);
    if (g && (!g->fc_w || !g->fc_b || !g->proj_w || !g->proj_b))
        return moe_bad("expert %d: a gradient pointer is NULL", index);
    return 0;
}

int moe_capacity(const struct moe_config *cfg, int N)
{
    int r = moe_check_config(cfg);
    if (r < 0) return r;
    if (N < 1 || N > MOE_MAX_TOKENS)
        return moe_bad("N=%d tokens is out of range: it must be in [1, %d]", N, MOE_MAX_TOKENS);
    double cap = ceil((double)N / cfg->E * (cfg->k * (double)cfg->capacity_factor));
    if (cap < cfg->min_capacity) cap = cfg->min_capacity;
    /* More slots than tokens change nothing; the bound keeps the count an int. */
    return cap > MOE_MAX_TOKENS ? MOE_MAX_TOKENS : (int)cap;
}

/* ---- the route ------------------------------------------------------------------------------ */

int moe_route_init(struct moe_route *r, const struct moe_config *cfg, int max_N)
{
    if (!r) return moe_bad("no route to fill");
    memset(r, 0, sizeof(*r));
    int rc = moe_check_config(cfg);
    if (rc < 0) return rc;
    if (max_N < 1 || max_N > MOE_MAX_TOKENS)
        return moe_bad("max_N=%d tokens is out of range: it must be in [1, %d]", max_N,
                       MOE_MAX_TOKENS);
    size_t N = (size_t)max_N, E = (size_t)cfg->E, k = (size_t)cfg->k;
    r->max_N = max_N;
    r->E = cfg->E;
    r->k = cfg->k;
    r->N = 0;
    r->gates = malloc(N * E * sizeof(float));
    r->logits = malloc(N * E * sizeof(float));
    r->ce = calloc(E, sizeof(float));
    r->expert = malloc(N * k * sizeof(int));
    r->slot = malloc(N * k * sizeof(int));
    r->weight = malloc(N * k * sizeof(float));
    r->count = calloc(E, sizeof(int));
    r->wanted = calloc(E, sizeof(int));
    r->slots = malloc(E * N * sizeof(struct moe_slot));
    if (!r->gates || !r->logits || !r->ce || !r->expert || !r->slot || !r->weight || !r->count ||
        !r->wanted || !r->slots) {
        moe_route_release(r);
        return -ENOMEM;
    }
    return 0;
}

void moe_route_release(struct moe_route *r)
{
    if (!r) return;
    free(r->gates);
    free(r->logits);
    free(r->ce);
    free(r->expert);
    free(r->slot);
    free(r->weight);
    free(r->count);
    free(r->wanted);
    free(r->slots);
    memset(r, 0, sizeof(*r));
}

int moe_route_experts_used(const struct moe_route *r, int *list)
{
    if (!r || !r->count) return moe_bad("no route (make one with moe_route_init)");
    int n = 0;
    for (int e = 0; e < r->E; e++)
        if (r->count[e] > 0) {
            if (list) list[n] = e;
            n++;
        }
    return n;
}

/* ---- scratch ---------------------------------------------------------------------------- */

static size_t pad(size_t n)
{
    return (n + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
}

/* The per-expert functions carve 3 (rows,4C) and 5 (rows,C) buffers and 2 of rows floats
 * (moe.c, carve()); the gate's backward one (N,E). */
static size_t scratch_floats(const struct moe_config *cfg, size_t rows)
{
    size_t C = (size_t)cfg->C, E = (size_t)cfg->E;
    size_t expert = 3 * pad(rows * 4 * C) + 5 * pad(rows * C) + 2 * pad(rows);
    size_t gate = pad(rows * E);
    return expert > gate ? expert : gate;
}

size_t moe_scratch_bytes(const struct moe_config *cfg, int rows)
{
    if (moe_config_validate(cfg, NULL, 0) < 0 || rows < 1 || rows > MOE_MAX_TOKENS) return 0;
    return scratch_floats(cfg, (size_t)rows) * sizeof(float) + SCRATCH_ALIGN_BYTES;
}

float *moe_scratch_base(const struct moe_config *cfg, int rows, struct moe_scratch *s)
{
    if (!s || !s->mem) {
        moe_bad("no scratch (size it with moe_scratch_bytes)");
        return NULL;
    }
    size_t need =
        scratch_floats(cfg, (size_t)(rows > 0 ? rows : 1)) * sizeof(float) + SCRATCH_ALIGN_BYTES;
    if (s->bytes < need) {
        moe_bad("scratch of %zu bytes is too small: %d rows need %zu (moe_scratch_bytes)", s->bytes,
                rows, need);
        return NULL;
    }
    uintptr_t a =
        ((uintptr_t)s->mem + SCRATCH_ALIGN_BYTES - 1) & ~(uintptr_t)(SCRATCH_ALIGN_BYTES - 1);
    return (float *)a;
}

/* ---- the gate forward -------------------------------------------------------------------- */

/* The lowest index of the largest of row (E), skipping skip (-1 for none). */
static int argmax(const float *row, int E, int skip)
{
    int best = -1;
    for (int e = 0; e < E; e++) {
        if (e == skip) continue;
        if (best < 0 || row[e] > row[best]) best = e;
    }
    return best;
}

/* The top-2 weights of one token from its two gates and what was kept: each choice's gate
 * counts (s1, s2) when kept, or always with norm_before_drop; the denominator is clamped at
 * MOE_DENOM_EPS as DeepSpeed's is. */
static void top2_weights(float g1, float g2, int kept1, int kept2, int before, float *w1, float *w2)
{
    float s1 = before || kept1 ? g1 : 0.0f, s2 = before || kept2 ? g2 : 0.0f;
    float d = s1 + s2;
    if (d < MOE_DENOM_EPS) d = MOE_DENOM_EPS;
    *w1 = kept1 ? s1 / d : 0.0f;
    *w2 = kept2 ? s2 / d : 0.0f;
}

int moe_gate_forward(const struct moe_config *cfg, int N, const float *x, const float *wg,
                     struct moe_route *r)
{
    if (!x || !wg) return moe_bad("gate forward: x or wg is NULL");
    int rc = moe_route_check_logits(cfg, N, r);
    if (rc < 0) return rc;
    /* logits (N,E) = x (N,C) @ wg^T, in fp32. */
    ops_gemm(0, 1, (size_t)N, (size_t)cfg->E, (size_t)cfg->C, x, (size_t)cfg->C, wg,
             (size_t)cfg->C, 0.0f, r->logits, (size_t)cfg->E);
    return moe_route_logits(cfg, N, r);
}

int moe_route_check_logits(const struct moe_config *cfg, int N, const struct moe_route *r)
{
    int rc = moe_check_config(cfg);
    if (rc < 0) return rc;
    if (!r || !r->gates) return moe_bad("no route (make one with moe_route_init)");
    if (r->E != cfg->E || r->k != cfg->k)
        return moe_bad("the route was made for E=%d top-%d, not for this config's E=%d top-%d",
                       r->E, r->k, cfg->E, cfg->k);
    if (N < 1 || N > r->max_N)
        return moe_bad("N=%d tokens is out of range: the route holds [1, %d]", N, r->max_N);
    return 0;
}

int moe_route_logits(const struct moe_config *cfg, int N, struct moe_route *r)
{
    int rc = moe_route_check_logits(cfg, N, r);
    if (rc < 0) return rc;
    const int E = cfg->E, k = cfg->k;
    const size_t Ez = (size_t)E;
    r->N = N;
    r->norm_before_drop = cfg->norm_before_drop;

    /* gates = the row-wise softmax of the logits, in fp32. */
#pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        const float *l = r->logits + (size_t)t * Ez;
        float *g = r->gates + (size_t)t * Ez;
        float m = l[0], sum = 0.0f;
        for (int e = 1; e < E; e++)
            m = l[e] > m ? l[e] : m;
        for (int e = 0; e < E; e++) {
            g[e] = expf(l[e] - m);
            sum += g[e];
        }
        for (int e = 0; e < E; e++)
            g[e] /= sum;
    }

    /* Choices and their places in the queues, in token order: first choices take slots
     * 0.., second choices queue after all first choices of their expert. */
    int *first = r->count; /* first choices per expert, then kept per expert */
    memset(first, 0, Ez * sizeof(int));
    memset(r->wanted, 0, Ez * sizeof(int));
    for (int t = 0; t < N; t++) {
        int e = argmax(r->gates + (size_t)t * Ez, E, -1);
        r->expert[(size_t)t * k] = e;
        r->slot[(size_t)t * k] = first[e]++;
    }
    memcpy(r->wanted, first, Ez * sizeof(int));
    if (k == 2) {
        for (int t = 0; t < N; t++) {
            /* DeepSpeed takes the second choice from the logits (its noise left out). */
            int e1 = r->expert[(size_t)t * 2];
            int e = argmax(r->logits + (size_t)t * Ez, E, e1);
            r->expert[(size_t)t * 2 + 1] = e;
            r->slot[(size_t)t * 2 + 1] = r->wanted[e]++;
        }
    }

    /* l_aux = E * sum_e me[e] * ce[e]: me the mean gate, ce the share of first choices,
     * each summed in token order in double. */
    double l_aux = 0.0;
    for (int e = 0; e < E; e++) {
        double me = 0.0;
        for (int t = 0; t < N; t++)
            me += r->gates[(size_t)t * Ez + (size_t)e];
        me /= N;
        double ce = (double)first[e] / N;
        r->ce[e] = (float)ce;
        l_aux += me * ce;
    }
    r->l_aux = (float)(E * l_aux);

    int cap = 0;
    if (cfg->drop_tokens) {
        cap = moe_capacity(cfg, N);
        if (cap > N) cap = N;
    } else {
        for (int e = 0; e < E; e++)
            cap = r->wanted[e] > cap ? r->wanted[e] : cap;
    }
    r->capacity = cap;

    /* Keep the choices inside the capacity; a kept expert's slots are 0..count-1 (first
     * choices come first, and both queues are filled without gaps). */
    r->dropped = 0;
    for (int e = 0; e < E; e++)
        r->count[e] = r->wanted[e] < cap ? r->wanted[e] : cap;
    for (int t = 0; t < N; t++) {
        int kept[2] = {0, 0};
        for (int j = 0; j < k; j++) {
            size_t i = (size_t)t * k + (size_t)j;
            if (r->slot[i] < cap) {
                int e = r->expert[i];
                r->slots[(size_t)e * (size_t)r->max_N + (size_t)r->slot[i]] =
                    (struct moe_slot){.token = t, .choice = j};
                kept[j] = 1;
            } else {
                r->slot[i] = -1;
                r->dropped++;
            }
        }
        const float *g = r->gates + (size_t)t * Ez;
        if (k == 1) {
            r->weight[t] = kept[0] ? g[r->expert[t]] : 0.0f;
        } else {
            size_t i = (size_t)t * 2;
            top2_weights(g[r->expert[i]], g[r->expert[i + 1]], kept[0], kept[1],
                         cfg->norm_before_drop, &r->weight[i], &r->weight[i + 1]);
        }
    }
    return 0;
}

/* ---- the gate backward ------------------------------------------------------------------- */

/* d_g (E) += dloss/dgates of token t through its weights, given d_weight (k). With
 * s_i the gate each choice counts (top2_weights) and D = s1 + s2 (clamped at eps):
 * w_i = s_i / D, so dw1/ds1 = s2 / D^2, dw1/ds2 = -s1 / D^2, and the other way round;
 * under the clamp D is a constant. A dropped choice's weight is the constant 0. */
static void weights_backward(const struct moe_route *r, int t, const float *d_weight, float *d_g)
{
    const size_t Ez = (size_t)r->E;
    const float *g = r->gates + (size_t)t * Ez;
    if (r->k == 1) {
        if (r->slot[t] >= 0) d_g[r->expert[t]] += d_weight[t];
        return;
    }
    size_t i = (size_t)t * 2;
    int e1 = r->expert[i], e2 = r->expert[i + 1];
    int kept1 = r->slot[i] >= 0, kept2 = r->slot[i + 1] >= 0;
    int before = r->norm_before_drop;
    int live1 = before || kept1, live2 = before || kept2; /* s_i depends on g_i */
    if (!kept1 && !kept2) return;
    double s1 = live1 ? g[e1] : 0.0, s2 = live2 ? g[e2] : 0.0;
    double dw1 = kept1 ? d_weight[i] : 0.0, dw2 = kept2 ? d_weight[i + 1] : 0.0;
    float dsum = (float)s1 + (float)s2;
    double ds1, ds2;
    if (dsum >= MOE_DENOM_EPS) {
        double D = (double)dsum, D2 = D * D;
        ds1 = s2 * (dw1 - dw2) / D2;
        ds2 = s1 * (dw2 - dw1) / D2;
    } else {
        ds1 = dw1 / MOE_DENOM_EPS;
        ds2 = dw2 / MOE_DENOM_EPS;
    }
    if (live1) d_g[e1] += (float)ds1;
    if (live2) d_g[e2] += (float)ds2;
}

int moe_gate_backward(const struct moe_config *cfg, const struct moe_route *r, const float *x,
                      const float *wg, const float *d_weight, float d_l_aux, float *d_x,
                      float *d_wg, struct moe_scratch *s)
{
    int rc = moe_check_config(cfg);
    if (rc < 0) return rc;
    if (!r || r->N < 1) return moe_bad("gate backward: no route (run moe_gate_forward first)");
    if ((rc = moe_check_route(cfg, r, r->N)) < 0) return rc;
    if (!x || !wg || !d_weight || !d_x || !d_wg)
        return moe_bad("gate backward: x, wg, d_weight, d_x or d_wg is NULL");
    if (!isfinite(d_l_aux))
        return moe_bad("gate backward: d_l_aux=%g is not finite", (double)d_l_aux);
    float *d_logits = moe_scratch_base(cfg, r->N, s);
    if (!d_logits) return -EINVAL;
    if ((rc = moe_gate_dlogits(cfg, r, d_weight, d_l_aux, d_logits)) < 0) return rc;
    const size_t N = (size_t)r->N, C = (size_t)cfg->C, Ez = (size_t)r->E;
    /* d_wg (E,C) += d_logits^T (E,N) @ x (N,C); d_x (N,C) += d_logits (N,E) @ wg (E,C). */
    ops_gemm(1, 0, Ez, C, N, d_logits, Ez, x, C, 1.0f, d_wg, C);
    ops_gemm(0, 0, N, C, Ez, d_logits, Ez, wg, C, 1.0f, d_x, C);
    return 0;
}

int moe_gate_dlogits(const struct moe_config *cfg, const struct moe_route *r,
                     const float *d_weight, float d_l_aux, float *d_logits)
{
    int rc = moe_check_config(cfg);
    if (rc < 0) return rc;
    if (!r || r->N < 1) return moe_bad("gate backward: no route (run moe_gate_forward first)");
    if ((rc = moe_check_route(cfg, r, r->N)) < 0) return rc;
    if (!d_weight || !d_logits) return moe_bad("gate backward: d_weight or d_logits is NULL");
    if (!isfinite(d_l_aux))
        return moe_bad("gate backward: d_l_aux=%g is not finite", (double)d_l_aux);
    const int N = r->N, E = r->E;
    const size_t Ez = (size_t)E;
    /* dl_aux/dgates[t,e] = E * ce[e] / N. */
    const double aux_scale = (double)d_l_aux * E / N;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        float *dg = d_logits + (size_t)t * Ez;
        const float *g = r->gates + (size_t)t * Ez;
        for (int e = 0; e < E; e++)
            dg[e] = (float)(aux_scale * r->ce[e]);
        weights_backward(r, t, d_weight, dg);
        /* Through the softmax: dlogit_e = g_e * (dg_e - sum_i g_i dg_i). */
        float dot = 0.0f;
        for (int e = 0; e < E; e++)
            dot += g[e] * dg[e];
        for (int e = 0; e < E; e++)
            dg[e] = g[e] * (dg[e] - dot);
    }
    return 0;
}
