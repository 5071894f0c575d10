/*
 * test_moe.c - src/train/moe*.c: the mixture-of-experts MLP of moe.h.
 *
 * The route is checked against hand-computed values on two tiny cases (top-1 and top-2,
 * with drops, both top-2 normalisations) and against a naive double-precision reference
 * written here from DeepSpeed's definitions, on odd small shapes (C=24, N=14, E=4 top-2 and
 * E=3 top-1, capacity factors 1.0 and 1.25 with drops, and without dropping). The forward is
 * checked against the reference's dense loops, the backward (experts, gate, x, and ln2 in the
 * half-block) against central finite differences of the reference in double. Then the
 * identities that a trainer relies on, bit for bit: one expert behind a gate is GPT's MLP;
 * the fetch-one-expert-at-a-time pieces are the whole layer; the result does not depend on
 * the thread count; and an expert-parallel group (ranks as threads, an in-memory all-to-all)
 * gives each rank what the rank alone gives. Last, the refusals of bad arguments.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "train/moe.h"
#include "train/ops.h"

#define MAXN 32   /* tokens of a test */
#define MAXE 8    /* experts of a test */
#define MAXP 8    /* ranks of a test */
#define AUX 0.37f /* d_l_aux of every backward here */

TestSuite(moe, .fini = test_leak_check);

/* ---- helpers --------------------------------------------------------------------------- */

static float urand(uint64_t *s) /* uniform in [-1, 1) */
{
    return (float)((double)(test_rand(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static float *falloc(size_t n)
{
    float *p = calloc(n ? n : 1, sizeof(float));
    cr_assert_not_null(p);
    return p;
}

static struct moe_config config(int C, int E, int k, float cf, int drop)
{
    struct moe_config c;
    moe_config_defaults(&c, C, E);
    c.k = k;
    c.capacity_factor = cf;
    c.min_capacity = 0;
    c.drop_tokens = drop;
    return c;
}

/* A layer's inputs: x (N,C), wg (E,C), E experts of P floats, R = dloss/dy (N,C). */
struct net {
    struct moe_config cfg;
    int N;
    size_t P;
    float *x, *wg, *ex, *R;
    struct moe_expert_params p[MAXE];
};

static void net_make(struct net *n, const struct moe_config *cfg, int N, uint64_t seed)
{
    cr_assert_leq(N, MAXN);
    cr_assert_leq(cfg->E, MAXE);
    n->cfg = *cfg;
    n->N = N;
    n->P = moe_expert_num_params(cfg->C);
    size_t C = (size_t)cfg->C, E = (size_t)cfg->E;
    n->x = falloc((size_t)N * C);
    n->wg = falloc(E * C);
    n->ex = falloc(E * n->P);
    n->R = falloc((size_t)N * C);
    uint64_t s = seed;
    for (size_t i = 0; i < (size_t)N * C; i++) {
        n->x[i] = urand(&s);
        n->R[i] = urand(&s);
    }
    for (size_t i = 0; i < E * C; i++)
        n->wg[i] = 0.5f * urand(&s);
    for (size_t e = 0; e < E; e++) {
        float *b = n->ex + e * n->P;
        moe_expert_params_at(cfg->C, b, &n->p[e]);
        for (size_t i = 0; i < n->P; i++)
            b[i] = 0.3f * urand(&s);
    }
}

static void net_free(struct net *n)
{
    free(n->x);
    free(n->wg);
    free(n->ex);
    free(n->R);
}

/* What a forward and backward of the layer give. */
struct out {
    float *y, *d_x, *d_wg, *g; /* (N,C), (N,C), (E,C), E*P */
    float l_aux;
    struct moe_expert_grads eg[MAXE];
};

static void out_make(struct out *o, const struct net *n)
{
    size_t C = (size_t)n->cfg.C, E = (size_t)n->cfg.E;
    o->y = falloc((size_t)n->N * C);
    o->d_x = falloc((size_t)n->N * C);
    o->d_wg = falloc(E * C);
    o->g = falloc(E * n->P);
    for (size_t e = 0; e < E; e++)
        moe_expert_grads_at(n->cfg.C, o->g + e * n->P, &o->eg[e]);
}

static void out_free(struct out *o)
{
    free(o->y);
    free(o->d_x);
    free(o->d_wg);
    free(o->g);
}

static int out_equal(const struct out *a, const struct out *b, const struct net *n)
{
    size_t NC = (size_t)n->N * n->cfg.C, EC = (size_t)n->cfg.E * n->cfg.C;
    return !memcmp(a->y, b->y, NC * sizeof(float)) && !memcmp(a->d_x, b->d_x, NC * sizeof(float)) &&
           !memcmp(a->d_wg, b->d_wg, EC * sizeof(float)) &&
           !memcmp(a->g, b->g, (size_t)n->cfg.E * n->P * sizeof(float)) &&
           !memcmp(&a->l_aux, &b->l_aux, sizeof(float));
}

/* The whole layer on one rank: forward, then backward with d_y = R. */
static void run_single(const struct net *n, struct out *o, struct moe_route *keep)
{
    struct moe_route r;
    cr_assert_eq(moe_route_init(&r, &n->cfg, n->N), 0);
    cr_assert_eq(moe_mlp_forward(&n->cfg, NULL, n->N, n->x, n->wg, n->p, o->y, &r), 0);
    o->l_aux = r.l_aux;
    cr_assert_eq(moe_mlp_backward(&n->cfg, NULL, n->N, n->x, n->wg, n->p, o->eg, &r, n->R, AUX,
                                  o->d_x, o->d_wg),
                 0);
    if (keep)
        *keep = r;
    else
        moe_route_release(&r);
}

/* ---- the reference, in double -----------------------------------------------------------------
 */

struct ref_route {
    int capacity, dropped;
    int expert[MAXN][2], slot[MAXN][2];
    double weight[MAXN][2];
    int count[MAXE];
    double l_aux;
};

/* DeepSpeed's top1gating / top2gating without noise, from their definitions: masks, cumsum
 * locations, capacity, and the weights masked before (or, norm_before_drop, after) they are
 * normalised. */
static void ref_route(const struct moe_config *cfg, int N, const double *x, const double *wg,
                      struct ref_route *rr)
{
    int C = cfg->C, E = cfg->E, k = cfg->k;
    double logits[MAXN][MAXE], g[MAXN][MAXE];
    for (int t = 0; t < N; t++) {
        double m = -INFINITY, s = 0;
        for (int e = 0; e < E; e++) {
            logits[t][e] = 0;
            for (int c = 0; c < C; c++)
                logits[t][e] += x[t * C + c] * wg[e * C + c];
            m = fmax(m, logits[t][e]);
        }
        for (int e = 0; e < E; e++)
            s += exp(logits[t][e] - m);
        for (int e = 0; e < E; e++)
            g[t][e] = exp(logits[t][e] - m) / s;
    }
    int n1[MAXE] = {0}, n2[MAXE] = {0}, loc[MAXN][2];
    for (int t = 0; t < N; t++) {
        int b = 0;
        for (int e = 1; e < E; e++)
            if (g[t][e] > g[t][b]) b = e;
        rr->expert[t][0] = b;
        loc[t][0] = n1[b]++;
    }
    for (int t = 0; k == 2 && t < N; t++) {
        int b = -1;
        for (int e = 0; e < E; e++)
            if (e != rr->expert[t][0] && (b < 0 || logits[t][e] > logits[t][b])) b = e;
        rr->expert[t][1] = b;
        loc[t][1] = n1[b] + n2[b]++;
    }
    int cap = 0;
    if (cfg->drop_tokens) {
        cap = (int)ceil((double)N / E * k * cfg->capacity_factor);
        if (cap < cfg->min_capacity) cap = cfg->min_capacity;
        if (cap > N) cap = N;
    } else {
        for (int e = 0; e < E; e++)
            if (n1[e] + n2[e] > cap) cap = n1[e] + n2[e];
    }
    rr->capacity = cap;
    rr->dropped = 0;
    memset(rr->count, 0, sizeof(rr->count));
    for (int t = 0; t < N; t++) {
        int kept[2] = {0, 0};
        for (int j = 0; j < k; j++) {
            kept[j] = loc[t][j] < cap;
            rr->slot[t][j] = kept[j] ? loc[t][j] : -1;
            if (kept[j])
                rr->count[rr->expert[t][j]]++;
            else
                rr->dropped++;
        }
        if (k == 1) {
            rr->weight[t][0] = kept[0] ? g[t][rr->expert[t][0]] : 0;
        } else {
            double s[2];
            for (int j = 0; j < 2; j++)
                s[j] = kept[j] || cfg->norm_before_drop ? g[t][rr->expert[t][j]] : 0;
            double d = fmax(s[0] + s[1], MOE_DENOM_EPS);
            for (int j = 0; j < 2; j++)
                rr->weight[t][j] = kept[j] ? s[j] / d : 0;
        }
    }
    rr->l_aux = 0;
    for (int e = 0; e < E; e++) {
        double me = 0;
        for (int t = 0; t < N; t++)
            me += g[t][e];
        rr->l_aux += me / N * ((double)n1[e] / N);
    }
    rr->l_aux *= E;
}

/* Everything the reference's loss depends on, in double. */
struct ref_in {
    const struct moe_config *cfg;
    int N;
    size_t P;
    double *x, *wg, *ex, *R; /* x is x2 when ln is set */
    double *ln_w, *ln_b;     /* (C), or NULL: no ln2 and no residual */
};

static double gelu(double v)
{
    return 0.5 * v * (1 + tanh(sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
}

/* y (C) += w * expert e (x (C)). */
static void ref_expert(const struct ref_in *in, int e, const double *x, double w, double *y)
{
    int C = in->cfg->C;
    const double *fw = in->ex + e * in->P, *fb = fw + 4 * C * C, *pw = fb + 4 * C,
                 *pb = pw + 4 * C * C;
    double h[4 * 64];
    cr_assert_leq(C, 64);
    for (int i = 0; i < 4 * C; i++) {
        double a = fb[i];
        for (int c = 0; c < C; c++)
            a += fw[i * C + c] * x[c];
        h[i] = gelu(a);
    }
    for (int c = 0; c < C; c++) {
        double a = pb[c];
        for (int i = 0; i < 4 * C; i++)
            a += pw[c * 4 * C + i] * h[i];
        y[c] += w * a;
    }
}

/* The output (N,C) into y (NULL: not wanted) and the loss sum(out * R) + AUX * l_aux. */
static double ref_loss(const struct ref_in *in, double *y, struct ref_route *rr)
{
    int N = in->N, C = in->cfg->C;
    double u[MAXN * 64], out[MAXN * 64] = {0};
    const double *xm = in->x;
    if (in->ln_w) { /* ln2, as ops_layernorm_forward: biased variance, eps inside the root */
        for (int t = 0; t < N; t++) {
            double m = 0, v = 0;
            for (int c = 0; c < C; c++)
                m += in->x[t * C + c];
            m /= C;
            for (int c = 0; c < C; c++)
                v += (in->x[t * C + c] - m) * (in->x[t * C + c] - m);
            v /= C;
            for (int c = 0; c < C; c++)
                u[t * C + c] =
                    (in->x[t * C + c] - m) / sqrt(v + OPS_LN_EPS) * in->ln_w[c] + in->ln_b[c];
        }
        xm = u;
    }
    ref_route(in->cfg, N, xm, in->wg, rr);
    for (int t = 0; t < N; t++)
        for (int j = 0; j < in->cfg->k; j++)
            if (rr->slot[t][j] >= 0)
                ref_expert(in, rr->expert[t][j], xm + t * C, rr->weight[t][j], out + t * C);
    double L = AUX * rr->l_aux;
    for (int i = 0; i < N * C; i++) {
        if (in->ln_w) out[i] += in->x[i];
        if (y) y[i] = out[i];
        L += out[i] * in->R[i];
    }
    return L;
}

static double *to_double(const float *f, size_t n)
{
    double *d = calloc(n ? n : 1, sizeof(double));
    cr_assert_not_null(d);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    return d;
}

static void ref_make(struct ref_in *in, const struct net *n)
{
    size_t C = (size_t)n->cfg.C;
    *in = (struct ref_in){.cfg = &n->cfg, .N = n->N, .P = n->P};
    in->x = to_double(n->x, (size_t)n->N * C);
    in->wg = to_double(n->wg, (size_t)n->cfg.E * C);
    in->ex = to_double(n->ex, (size_t)n->cfg.E * n->P);
    in->R = to_double(n->R, (size_t)n->N * C);
}

static void ref_free(struct ref_in *in)
{
    free(in->x);
    free(in->wg);
    free(in->ex);
    free(in->R);
    free(in->ln_w);
    free(in->ln_b);
}

static int same_route(const struct ref_route *a, const struct ref_route *b, int N, int k)
{
    for (int t = 0; t < N; t++)
        for (int j = 0; j < k; j++)
            if (a->expert[t][j] != b->expert[t][j] || a->slot[t][j] != b->slot[t][j]) return 0;
    return 1;
}

/* Central differences of the reference's loss for every stride-th element of v (n), against
 * the module's gradient g; a step that changes the route is skipped (selection and capacity
 * are piecewise constant) and counted. Returns the number of elements compared. */
static int check_fd(struct ref_in *in, double *v, size_t n, size_t stride, const float *g,
                    const char *what, int *skipped)
{
    struct ref_route r0, rp, rm;
    ref_loss(in, NULL, &r0);
    int compared = 0;
    for (size_t i = 0; i < n; i += stride) {
        const double h = 1e-5, keep = v[i];
        v[i] = keep + h;
        double lp = ref_loss(in, NULL, &rp);
        v[i] = keep - h;
        double lm = ref_loss(in, NULL, &rm);
        v[i] = keep;
        if (!same_route(&r0, &rp, in->N, in->cfg->k) || !same_route(&r0, &rm, in->N, in->cfg->k)) {
            (*skipped)++;
            continue;
        }
        double fd = (lp - lm) / (2 * h);
        cr_assert(fabs(fd - g[i]) <= 2e-4 + 2e-3 * fabs(fd),
                  "%s[%zu]: finite difference %.8g, "
                  "backward %.8g",
                  what, i, fd, (double)g[i]);
        compared++;
    }
    return compared;
}

/* The configurations of the brief: odd small shapes, drops and no drops. */
static const struct {
    int E, k;
    float cf;
    int drop, before, must_drop;
} shapes[] = {
    {4, 2, 1.0f, 1, 0, 1}, {4, 2, 1.25f, 1, 0, 0}, {4, 2, 1.0f, 1, 1, 1}, {4, 2, 1.0f, 0, 0, 0},
    {3, 1, 1.0f, 1, 0, 1}, {3, 1, 1.25f, 1, 0, 0}, {3, 1, 1.0f, 0, 0, 0},
};
#define NSHAPES (sizeof(shapes) / sizeof(shapes[0]))
#define TC 24      /* channels */
#define TN (2 * 7) /* tokens: B=2, T=7 */

static struct moe_config shape_config(size_t i)
{
    struct moe_config c = config(TC, shapes[i].E, shapes[i].k, shapes[i].cf, shapes[i].drop);
    c.norm_before_drop = shapes[i].before;
    return c;
}

/* ---- the route ------------------------------------------------------------------------------ */

/* wg the identity, so the logits are x itself. */
static void identity_gate(float *wg, int E, int C)
{
    memset(wg, 0, (size_t)E * C * sizeof(float));
    for (int e = 0; e < E && e < C; e++)
        wg[e * C + e] = 1.0f;
}

Test(moe, route_top1_by_hand)
{
    /* Logits (2,0), (1,0), (0,1), (3,0); capacity ceil(4/2 * 1.0) = 2: expert 0 wants three
     * tokens and drops the last (token 3). */
    struct moe_config cfg = config(2, 2, 1, 1.0f, 1);
    const float x[] = {2, 0, 1, 0, 0, 1, 3, 0};
    float wg[4];
    identity_gate(wg, 2, 2);
    struct moe_route r;
    cr_assert_eq(moe_route_init(&r, &cfg, 4), 0);
    cr_assert_eq(moe_gate_forward(&cfg, 4, x, wg, &r), 0);
    cr_assert_eq(r.capacity, 2);
    cr_assert_eq(r.count[0], 2);
    cr_assert_eq(r.count[1], 1);
    cr_assert_eq(r.wanted[0], 3);
    cr_assert_eq(r.dropped, 1);
    const int expert[] = {0, 0, 1, 0}, slot[] = {0, 1, 0, -1};
    const double weight[] = {0.8807970779778823, 0.7310585786300049, 0.7310585786300049, 0};
    for (int t = 0; t < 4; t++) {
        cr_assert_eq(r.expert[t], expert[t], "token %d", t);
        cr_assert_eq(r.slot[t], slot[t], "token %d", t);
        cr_assert_float_eq(r.weight[t], weight[t], 1e-6, "token %d", t);
    }
    cr_assert_eq(r.slots[0].token, 0);
    cr_assert_eq(r.slots[1].token, 1);
    cr_assert_eq(r.slots[r.max_N].token, 2);
    /* l_aux = 2 * (me0 * 3/4 + me1 * 1/4), me the mean gates. */
    cr_assert_float_eq(r.l_aux, 1.208342801200079, 1e-6);
    int used[2];
    cr_assert_eq(moe_route_experts_used(&r, used), 2);
    moe_route_release(&r);
    moe_route_release(&r); /* twice is fine */
}

Test(moe, route_top2_by_hand)
{
    /* Logits (3,1,0), (2,0,1), (0,2,1), (1,0,2), capacity ceil(4/3 * 2 * 0.5) = 2. First
     * choices 0,0,1,2 take slots 0,1 of expert 0 and 0 of experts 1 and 2; the seconds 1,2,2,0
     * queue behind them: token 0 at slot 1 of expert 1, token 1 at slot 1 of expert 2, and
     * tokens 2 and 3 at slot 2 (dropped). */
    struct moe_config cfg = config(3, 3, 2, 0.5f, 1);
    const float x[] = {3, 1, 0, 2, 0, 1, 0, 2, 1, 1, 0, 2};
    float wg[9];
    identity_gate(wg, 3, 3);
    for (int before = 0; before < 2; before++) {
        cfg.norm_before_drop = before;
        struct moe_route r;
        cr_assert_eq(moe_route_init(&r, &cfg, 4), 0);
        cr_assert_eq(moe_gate_forward(&cfg, 4, x, wg, &r), 0);
        cr_assert_eq(r.capacity, 2);
        cr_assert_eq(r.dropped, 2);
        const int expert[] = {0, 1, 0, 2, 1, 2, 2, 0}, slot[] = {0, 1, 1, 1, 0, -1, 0, -1};
        for (int i = 0; i < 8; i++) {
            cr_assert_eq(r.expert[i], expert[i], "choice %d", i);
            cr_assert_eq(r.slot[i], slot[i], "choice %d", i);
        }
        for (int e = 0; e < 3; e++)
            cr_assert_eq(r.count[e], 2);
        cr_assert_eq(r.wanted[2], 3);
        /* Tokens 0 and 1 keep both: g/(g1+g2). Tokens 2 and 3 keep only their first, which
         * DeepSpeed normalises over the kept (1) and fairseq's option over both. */
        const double w[] = {0.8807970779778825,
                            0.11920292202211757,
                            0.7310585786300048,
                            0.26894142136999516,
                            before ? 0.7310585786300048 : 1.0,
                            0,
                            before ? 0.7310585786300048 : 1.0,
                            0};
        for (int i = 0; i < 8; i++)
            cr_assert_float_eq(r.weight[i], w[i], 1e-6, "choice %d (before %d)", i, before);
        cr_assert_float_eq(r.l_aux, 1.095711512715251, 1e-6);
        cr_assert_eq(r.slots[1 * r.max_N + 1].token, 0);
        cr_assert_eq(r.slots[1 * r.max_N + 1].choice, 1);
        moe_route_release(&r);
    }
}

Test(moe, capacity)
{
    struct moe_config c = config(8, 4, 2, 1.25f, 1);
    cr_assert_eq(moe_capacity(&c, 14), 9); /* ceil(14/4 * 2.5) */
    c.k = 1;
    cr_assert_eq(moe_capacity(&c, 14), 5); /* ceil(4.375) */
    c.E = 3;
    c.capacity_factor = 1.0f;
    cr_assert_eq(moe_capacity(&c, 14), 5); /* ceil(4.67) */
    c.min_capacity = 4;
    cr_assert_eq(moe_capacity(&c, 6), 4); /* ceil(2) raised to the minimum */
    cr_assert_eq(moe_capacity(&c, 0), -EINVAL);
    c.capacity_factor = 0.0f;
    cr_assert_eq(moe_capacity(&c, 6), -EINVAL);
}

Test(moe, route_matches_reference)
{
    for (size_t i = 0; i < NSHAPES; i++) {
        struct moe_config cfg = shape_config(i);
        struct net n;
        net_make(&n, &cfg, TN, 100 + i);
        struct ref_in in;
        ref_make(&in, &n);
        struct ref_route rr;
        ref_loss(&in, NULL, &rr);
        struct moe_route r;
        cr_assert_eq(moe_route_init(&r, &cfg, TN), 0);
        cr_assert_eq(moe_gate_forward(&cfg, TN, n.x, n.wg, &r), 0);
        cr_assert_eq(r.capacity, rr.capacity, "shape %zu", i);
        cr_assert_eq(r.dropped, rr.dropped, "shape %zu", i);
        if (shapes[i].must_drop) cr_assert_gt(r.dropped, 0, "shape %zu drops nothing", i);
        if (!shapes[i].drop) cr_assert_eq(r.dropped, 0, "shape %zu", i);
        int used = 0;
        for (int e = 0; e < cfg.E; e++) {
            cr_assert_eq(r.count[e], rr.count[e], "shape %zu expert %d", i, e);
            used += r.count[e] > 0;
        }
        cr_assert_eq(moe_route_experts_used(&r, NULL), used);
        for (int t = 0; t < TN; t++)
            for (int j = 0; j < cfg.k; j++) {
                size_t c = (size_t)t * cfg.k + j;
                cr_assert_eq(r.expert[c], rr.expert[t][j], "shape %zu token %d", i, t);
                cr_assert_eq(r.slot[c], rr.slot[t][j], "shape %zu token %d", i, t);
                cr_assert_float_eq(r.weight[c], rr.weight[t][j], 1e-6, "shape %zu token %d", i, t);
                if (r.slot[c] >= 0) { /* the expert's list names this choice at its slot */
                    struct moe_slot s = r.slots[(size_t)r.expert[c] * r.max_N + r.slot[c]];
                    cr_assert(s.token == t && s.choice == j, "shape %zu token %d", i, t);
                }
            }
        cr_assert_float_eq(r.l_aux, rr.l_aux, 1e-6, "shape %zu", i);
        moe_route_release(&r);
        ref_free(&in);
        net_free(&n);
    }
}

/* ---- forward and backward against the reference --------------------------------------------- */

Test(moe, forward_matches_reference)
{
    for (size_t i = 0; i < NSHAPES; i++) {
        struct moe_config cfg = shape_config(i);
        struct net n;
        net_make(&n, &cfg, TN, 200 + i);
        struct out o;
        out_make(&o, &n);
        run_single(&n, &o, NULL);
        struct ref_in in;
        ref_make(&in, &n);
        struct ref_route rr;
        double y[MAXN * TC];
        ref_loss(&in, y, &rr);
        for (int j = 0; j < TN * TC; j++)
            cr_assert(fabs(o.y[j] - y[j]) <= 1e-5, "shape %zu y[%d]: %.8g, reference %.8g", i, j,
                      (double)o.y[j], y[j]);
        cr_assert_float_eq(o.l_aux, rr.l_aux, 1e-6);
        ref_free(&in);
        out_free(&o);
        net_free(&n);
    }
}

Test(moe, backward_matches_finite_differences)
{
    for (size_t i = 0; i < NSHAPES; i++) {
        struct moe_config cfg = shape_config(i);
        struct net n;
        net_make(&n, &cfg, TN, 300 + i);
        struct out o;
        out_make(&o, &n);
        run_single(&n, &o, NULL);
        struct ref_in in;
        ref_make(&in, &n);
        int skipped = 0, compared = 0;
        /* Strides prime to the tensors' sizes, so that each tensor of each expert is hit. */
        compared += check_fd(&in, in.x, (size_t)TN * TC, 2, o.d_x, "d_x", &skipped);
        compared += check_fd(&in, in.wg, (size_t)cfg.E * TC, 1, o.d_wg, "d_wg", &skipped);
        compared += check_fd(&in, in.ex, (size_t)cfg.E * n.P, 31, o.g, "expert grads", &skipped);
        cr_assert_lt(skipped, compared / 100 + 1, "shape %zu: %d of the steps changed the route", i,
                     skipped);
        ref_free(&in);
        out_free(&o);
        net_free(&n);
    }
}

Test(moe, sublock_matches_finite_differences)
{
    struct moe_config cfg = shape_config(0);
    struct net n;
    net_make(&n, &cfg, TN, 400);
    float ln_w[TC], ln_b[TC], d_ln_w[TC] = {0}, d_ln_b[TC] = {0};
    uint64_t s = 401;
    for (int c = 0; c < TC; c++) {
        ln_w[c] = 1.0f + 0.2f * urand(&s);
        ln_b[c] = 0.1f * urand(&s);
    }
    struct out o;
    out_make(&o, &n);
    float l_aux;
    cr_assert_eq(moe_sublock_forward(&cfg, NULL, TN, n.x, ln_w, ln_b, n.wg, n.p, o.y, &l_aux), 0);
    /* The same as ln2, the layer and the residual add put together by hand. */
    float *ln = falloc(TN * TC), *y = falloc(TN * TC), mean[TN], rstd[TN];
    ops_layernorm_forward(ln, mean, rstd, n.x, ln_w, ln_b, TN, TC);
    struct moe_route r;
    cr_assert_eq(moe_route_init(&r, &cfg, TN), 0);
    cr_assert_eq(moe_mlp_forward(&cfg, NULL, TN, ln, n.wg, n.p, y, &r), 0);
    ops_add(y, y, n.x, TN * TC);
    cr_assert_eq(memcmp(y, o.y, sizeof(float) * TN * TC), 0);
    cr_assert_eq(memcmp(&l_aux, &r.l_aux, sizeof(float)), 0);
    moe_route_release(&r);

    float *d_x2 = falloc(TN * TC);
    memcpy(d_x2, n.R, sizeof(float) * TN * TC); /* in place: d_x2 is d_out */
    cr_assert_eq(moe_sublock_backward(&cfg, NULL, TN, n.x, ln_w, ln_b, n.wg, n.p, d_x2, AUX, d_x2,
                                      d_ln_w, d_ln_b, o.d_wg, o.eg),
                 0);
    struct ref_in in;
    ref_make(&in, &n);
    in.ln_w = to_double(ln_w, TC);
    in.ln_b = to_double(ln_b, TC);
    int skipped = 0, compared = 0;
    compared += check_fd(&in, in.x, TN * TC, 1, d_x2, "d_x2", &skipped);
    compared += check_fd(&in, in.ln_w, TC, 1, d_ln_w, "d_ln2_w", &skipped);
    compared += check_fd(&in, in.ln_b, TC, 1, d_ln_b, "d_ln2_b", &skipped);
    compared += check_fd(&in, in.wg, (size_t)cfg.E * TC, 1, o.d_wg, "d_wg", &skipped);
    compared += check_fd(&in, in.ex, (size_t)cfg.E * n.P, 31, o.g, "expert grads", &skipped);
    cr_assert_lt(skipped, compared / 100 + 1);
    ref_free(&in);
    free(d_x2);
    free(ln);
    free(y);
    out_free(&o);
    net_free(&n);
}

/* ---- identities: one expert, the pieces, the thread count ------------------------------------ */

Test(moe, one_expert_is_gpt_mlp)
{
    /* One expert behind a softmax over one logit: every gate is exactly 1, no token is
     * dropped (capacity factor 4), so the layer is GPT's MLP, bit for bit, and the gate's
     * gradient is exactly 0. */
    struct moe_config cfg = config(TC, 1, 1, 4.0f, 1);
    struct net n;
    net_make(&n, &cfg, TN, 500);
    struct out o;
    out_make(&o, &n);
    run_single(&n, &o, NULL);
    const struct moe_expert_params *p = &n.p[0];
    float *h = falloc(TN * 4 * TC), *hg = falloc(TN * 4 * TC), *dh = falloc(TN * 4 * TC);
    float *y = falloc(TN * TC), *d_x = falloc(TN * TC), *g = falloc(n.P);
    ops_linear_forward(h, n.x, p->fc_w, p->fc_b, NULL, TN, TC, 4 * TC);
    ops_gelu_forward(hg, h, TN * 4 * TC);
    ops_linear_forward(y, hg, p->proj_w, p->proj_b, NULL, TN, 4 * TC, TC);
    cr_assert_eq(memcmp(y, o.y, sizeof(float) * TN * TC), 0, "forward differs from the MLP");
    struct moe_expert_grads eg;
    moe_expert_grads_at(TC, g, &eg);
    ops_linear_backward(dh, eg.proj_w, eg.proj_b, n.R, hg, p->proj_w, TN, 4 * TC, TC);
    ops_gelu_backward(dh, h, TN * 4 * TC);
    ops_linear_backward(d_x, eg.fc_w, eg.fc_b, dh, n.x, p->fc_w, TN, TC, 4 * TC);
    cr_assert_eq(memcmp(g, o.g, sizeof(float) * n.P), 0, "parameter gradients differ");
    cr_assert_eq(memcmp(d_x, o.d_x, sizeof(float) * TN * TC), 0, "d_x differs");
    for (int c = 0; c < TC; c++)
        cr_assert_eq(o.d_wg[c], 0.0f);
    cr_assert_float_eq(o.l_aux, 1.0, 1e-7); /* E * mean gate (1) * share (1) */
    free(h);
    free(hg);
    free(dh);
    free(y);
    free(d_x);
    free(g);
    out_free(&o);
    net_free(&n);
}

Test(moe, pieces_are_the_layer)
{
    /* What a trainer that fetches one expert at a time runs: the gate, then each used expert
     * forward; each used expert backward, then the gate. The same bits as the whole layer. */
    for (size_t i = 0; i < NSHAPES; i++) {
        struct moe_config cfg = shape_config(i);
        struct net n;
        net_make(&n, &cfg, TN, 600 + i);
        struct out whole, o;
        out_make(&whole, &n);
        out_make(&o, &n);
        run_single(&n, &whole, NULL);
        struct moe_route r;
        cr_assert_eq(moe_route_init(&r, &cfg, TN), 0);
        cr_assert_eq(moe_gate_forward(&cfg, TN, n.x, n.wg, &r), 0);
        o.l_aux = r.l_aux;
        struct moe_scratch s = {.bytes = moe_scratch_bytes(&cfg, TN)};
        s.mem = malloc(s.bytes);
        cr_assert_not_null(s.mem);
        int used[MAXE], nused = moe_route_experts_used(&r, used);
        cr_assert_gt(nused, 0);
        for (int u = 0; u < nused; u++)
            cr_assert_eq(moe_expert_forward(&cfg, &r, used[u], &n.p[used[u]], n.x, o.y, &s), 0);
        float d_weight[MAXN * 2] = {0};
        for (int u = 0; u < nused; u++)
            cr_assert_eq(moe_expert_backward(&cfg, &r, used[u], &n.p[used[u]], &o.eg[used[u]], n.x,
                                             n.R, o.d_x, d_weight, &s),
                         0);
        cr_assert_eq(moe_gate_backward(&cfg, &r, n.x, n.wg, d_weight, AUX, o.d_x, o.d_wg, &s), 0);
        cr_assert(out_equal(&o, &whole, &n), "shape %zu: the pieces differ from the layer", i);
        free(s.mem);
        moe_route_release(&r);
        out_free(&o);
        out_free(&whole);
        net_free(&n);
    }
}

Test(moe, thread_count_does_not_change_bits)
{
    int threads = omp_get_max_threads();
    for (size_t i = 0; i < NSHAPES; i++) {
        struct moe_config cfg = shape_config(i);
        cfg.C = 40; /* wider, so that the GEMMs and row loops have something to split */
        struct net n;
        net_make(&n, &cfg, MAXN, 700 + i);
        struct out a, b;
        out_make(&a, &n);
        out_make(&b, &n);
        omp_set_num_threads(1);
        run_single(&n, &a, NULL);
        omp_set_num_threads(3);
        run_single(&n, &b, NULL);
        omp_set_num_threads(threads);
        cr_assert(out_equal(&a, &b, &n), "shape %zu: 1 and 3 threads differ", i);
        out_free(&a);
        out_free(&b);
        net_free(&n);
    }
}

/* ---- expert parallelism ------------------------------------------------------------------------
 */

/* An in-memory all-to-all among threads: each rank posts its send buffer, all wait, each
 * copies its block from every rank, all wait again (so no send buffer is reused early). */
struct group {
    int P;
    pthread_barrier_t bar;
    const float *send[MAXP];
    size_t count[MAXP];
};

struct rank_ctx {
    struct group *g;
    int rank, calls;
    int fail_call; /* answer -EIO on this call (-1: never) */
    int corrupt;   /* spoil the first block received (the counts) */
};

static int mem_alltoall(const float *send, float *recv, size_t count, void *ctx)
{
    struct rank_ctx *rc = ctx;
    struct group *g = rc->g;
    int call = rc->calls++;
    if (call == rc->fail_call) return -EIO;
    g->send[rc->rank] = send;
    g->count[rc->rank] = count;
    pthread_barrier_wait(&g->bar);
    int res = 0;
    for (int s = 0; s < g->P; s++)
        if (g->count[s] != count) res = -EINVAL;
    for (int s = 0; s < g->P && !res; s++)
        memcpy(recv + (size_t)s * count, g->send[s] + (size_t)rc->rank * count,
               count * sizeof(float));
    pthread_barrier_wait(&g->bar);
    if (rc->corrupt && call == 0) recv[1] = 1.5f;
    return res;
}

struct rank_job {
    const struct moe_config *cfg;
    struct moe_ep ep;
    struct rank_ctx ctx;
    const struct net *n;
    struct out *o;
    struct moe_expert_grads *eg; /* this rank's experts' */
    const float *ln_w, *ln_b;    /* set: run the half-block instead of the layer */
    float *d_ln;                 /* (2C): d_ln2_w, d_ln2_b */
    int rc;
};

/* The half-block on one rank of a group (or alone, ep NULL): x_out into o->y, d_x2 into
 * o->d_x. */
static int sublock(const struct moe_config *cfg, const struct moe_ep *ep, const struct net *n,
                   const struct moe_expert_params *p, struct moe_expert_grads *eg,
                   const float *ln_w, const float *ln_b, float *d_ln, struct out *o)
{
    int rc = moe_sublock_forward(cfg, ep, n->N, n->x, ln_w, ln_b, n->wg, p, o->y, &o->l_aux);
    if (rc == 0)
        rc = moe_sublock_backward(cfg, ep, n->N, n->x, ln_w, ln_b, n->wg, p, n->R, AUX, o->d_x,
                                  d_ln, d_ln + cfg->C, o->d_wg, eg);
    return rc;
}

static void *rank_main(void *arg)
{
    struct rank_job *j = arg;
    const struct net *n = j->n;
    int Epr = j->cfg->E / j->ep.ep;
    if (j->ln_w) {
        j->rc = sublock(j->cfg, &j->ep, n, n->p + j->ep.rank * Epr, j->eg, j->ln_w, j->ln_b,
                        j->d_ln, j->o);
        return NULL;
    }
    struct moe_route r;
    j->rc = moe_route_init(&r, j->cfg, n->N);
    if (j->rc == 0)
        j->rc = moe_mlp_forward(j->cfg, &j->ep, n->N, n->x, n->wg, n->p + j->ep.rank * Epr, j->o->y,
                                &r);
    j->o->l_aux = r.l_aux;
    if (j->rc == 0)
        j->rc = moe_mlp_backward(j->cfg, &j->ep, n->N, n->x, n->wg, n->p + j->ep.rank * Epr, j->eg,
                                 &r, n->R, AUX, j->o->d_x, j->o->d_wg);
    moe_route_release(&r);
    return NULL;
}

/* Runs the layer on P ranks with nets[] as their tokens; the experts' gradients land in
 * o[owner].eg. Returns the first rank's error, or 0. */
static int run_group(const struct moe_config *cfg, int P, const struct net *nets, struct out *o,
                     int fail_call, int corrupt, const float *ln, float *d_ln)
{
    struct group g = {.P = P};
    struct rank_job jobs[MAXP];
    pthread_t th[MAXP];
    pthread_barrier_init(&g.bar, NULL, (unsigned)P);
    int Epr = cfg->E / P;
    for (int r = 0; r < P; r++) {
        jobs[r] = (struct rank_job){.cfg = cfg, .n = &nets[r], .o = &o[r]};
        jobs[r].ctx =
            (struct rank_ctx){.g = &g, .rank = r, .fail_call = fail_call, .corrupt = corrupt};
        jobs[r].ep =
            (struct moe_ep){.ep = P, .rank = r, .alltoall = mem_alltoall, .ctx = &jobs[r].ctx};
        jobs[r].eg = o[r].eg + r * Epr;
        if (ln) {
            jobs[r].ln_w = ln;
            jobs[r].ln_b = ln + cfg->C;
            jobs[r].d_ln = d_ln + (size_t)r * 2 * cfg->C;
        }
        cr_assert_eq(pthread_create(&th[r], NULL, rank_main, &jobs[r]), 0);
    }
    int rc = 0;
    for (int r = 0; r < P; r++) {
        pthread_join(th[r], NULL);
        if (!rc) rc = jobs[r].rc;
    }
    pthread_barrier_destroy(&g.bar);
    return rc;
}

/* P ranks' tokens, each its own x and R (and, with vary, its own count), one wg and one set
 * of experts. */
static void group_nets(struct net *nets, const struct moe_config *cfg, int P, int vary,
                       uint64_t seed)
{
    for (int r = 0; r < P; r++) {
        net_make(&nets[r], cfg, vary ? TN - 3 * r : TN, seed + (uint64_t)r);
        memcpy(nets[r].wg, nets[0].wg, sizeof(float) * cfg->E * cfg->C);
        memcpy(nets[r].ex, nets[0].ex, sizeof(float) * cfg->E * nets[0].P);
    }
}

Test(moe, expert_parallel_matches_one_rank)
{
    static const struct {
        size_t shape;
        int P, vary;
    } cases[] = {{0, 1, 0}, {0, 2, 0}, {0, 4, 0}, {1, 2, 0}, {2, 4, 0},
                 {3, 2, 1}, {3, 4, 1}, {4, 3, 0}, {5, 3, 0}, {6, 3, 1}};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        struct moe_config cfg = shape_config(cases[c].shape);
        int P = cases[c].P;
        struct net nets[MAXP];
        struct out ep[MAXP], one[MAXP];
        group_nets(nets, &cfg, P, cases[c].vary, 800 + 10 * c);
        /* One rank at a time, alone, the ranks' expert gradients added in rank order into
         * rank 0's, as the owner adds them. */
        for (int r = 0; r < P; r++) {
            out_make(&ep[r], &nets[r]);
            out_make(&one[r], &nets[r]);
            for (int e = 0; e < cfg.E; e++)
                one[r].eg[e] = one[0].eg[e];
            run_single(&nets[r], &one[r], NULL);
        }
        for (int r = 1; r < P; r++) /* the owners' gradients, gathered in rank 0's */
            for (int e = 0; e < cfg.E; e++)
                ep[r].eg[e] = ep[0].eg[e];
        cr_assert_eq(run_group(&cfg, P, nets, ep, -1, 0, NULL, NULL), 0, "case %zu", c);
        for (int r = 0; r < P; r++) {
            size_t NC = (size_t)nets[r].N * cfg.C;
            cr_assert_eq(memcmp(ep[r].y, one[r].y, NC * sizeof(float)), 0, "case %zu rank %d y", c,
                         r);
            cr_assert_eq(memcmp(ep[r].d_x, one[r].d_x, NC * sizeof(float)), 0,
                         "case %zu rank %d d_x", c, r);
            cr_assert_eq(memcmp(ep[r].d_wg, one[r].d_wg, sizeof(float) * cfg.E * cfg.C), 0,
                         "case %zu rank %d d_wg", c, r);
            cr_assert_eq(memcmp(&ep[r].l_aux, &one[r].l_aux, sizeof(float)), 0);
        }
        cr_assert_eq(memcmp(ep[0].g, one[0].g, sizeof(float) * cfg.E * nets[0].P), 0,
                     "case %zu: expert gradients differ", c);
        for (int r = 0; r < P; r++) {
            out_free(&ep[r]);
            out_free(&one[r]);
            net_free(&nets[r]);
        }
    }
}

Test(moe, expert_parallel_sublock_matches_one_rank)
{
    struct moe_config cfg = shape_config(3); /* no drops, ranks of 14, 11, 8 and 5 tokens */
    const int P = 4;
    float ln[2 * TC], d_one[MAXP * 2 * TC] = {0}, d_ep[MAXP * 2 * TC] = {0};
    uint64_t s = 1200;
    for (int c = 0; c < TC; c++) {
        ln[c] = 1.0f + 0.2f * urand(&s);
        ln[TC + c] = 0.1f * urand(&s);
    }
    struct net nets[MAXP];
    struct out ep[MAXP], one[MAXP];
    group_nets(nets, &cfg, P, 1, 1201);
    for (int r = 0; r < P; r++) {
        out_make(&ep[r], &nets[r]);
        out_make(&one[r], &nets[r]);
        if (r)
            for (int e = 0; e < cfg.E; e++) {
                one[r].eg[e] = one[0].eg[e];
                ep[r].eg[e] = ep[0].eg[e];
            }
        cr_assert_eq(sublock(&cfg, NULL, &nets[r], nets[r].p, one[r].eg, ln, ln + TC,
                             d_one + r * 2 * TC, &one[r]),
                     0);
    }
    cr_assert_eq(run_group(&cfg, P, nets, ep, -1, 0, ln, d_ep), 0);
    for (int r = 0; r < P; r++) {
        size_t NC = (size_t)nets[r].N * cfg.C;
        cr_assert_eq(memcmp(ep[r].y, one[r].y, NC * sizeof(float)), 0, "rank %d x_out", r);
        cr_assert_eq(memcmp(ep[r].d_x, one[r].d_x, NC * sizeof(float)), 0, "rank %d d_x2", r);
        cr_assert_eq(memcmp(ep[r].d_wg, one[r].d_wg, sizeof(float) * cfg.E * cfg.C), 0);
        cr_assert_eq(memcmp(&ep[r].l_aux, &one[r].l_aux, sizeof(float)), 0);
    }
    cr_assert_eq(memcmp(d_ep, d_one, sizeof(d_ep)), 0, "ln2's gradients differ");
    cr_assert_eq(memcmp(ep[0].g, one[0].g, sizeof(float) * cfg.E * nets[0].P), 0);
    for (int r = 0; r < P; r++) {
        out_free(&ep[r]);
        out_free(&one[r]);
        net_free(&nets[r]);
    }
}

Test(moe, expert_parallel_failures_are_passed_up)
{
    struct moe_config cfg = shape_config(0);
    for (int fail = 0; fail < 6; fail++) { /* forward: 3 calls; backward: 3 */
        struct net nets[2];
        struct out o[2];
        group_nets(nets, &cfg, 2, 0, 900);
        for (int r = 0; r < 2; r++)
            out_make(&o[r], &nets[r]);
        o[1].eg[0] = o[0].eg[0];
        cr_assert_eq(run_group(&cfg, 2, nets, o, fail, 0, NULL, NULL), -EIO, "call %d", fail);
        for (int r = 0; r < 2; r++) {
            out_free(&o[r]);
            net_free(&nets[r]);
        }
    }
    struct net nets[2];
    struct out o[2];
    group_nets(nets, &cfg, 2, 0, 901);
    for (int r = 0; r < 2; r++)
        out_make(&o[r], &nets[r]);
    test_log_capture_start();
    cr_assert_eq(run_group(&cfg, 2, nets, o, -1, 1, NULL, NULL), -EPROTO);
    cr_assert_not_null(strstr(test_log_text(), "not a count"), "log: %s", test_log_text());
    test_log_capture_stop();
    for (int r = 0; r < 2; r++) {
        out_free(&o[r]);
        net_free(&nets[r]);
    }
}

Test(moe, pack_and_unpack)
{
    struct moe_config cfg = shape_config(0);
    struct net n;
    net_make(&n, &cfg, TN, 1000);
    struct moe_route r;
    cr_assert_eq(moe_route_init(&r, &cfg, TN), 0);
    cr_assert_eq(moe_gate_forward(&cfg, TN, n.x, n.wg, &r), 0);
    const int P = 2, Epr = cfg.E / P, cap = r.capacity + 1; /* a group's larger capacity */
    size_t bf = moe_ep_block_floats(&cfg, P, cap, TC);
    cr_assert_eq(bf, (size_t)Epr * cap * TC);
    cr_assert_eq(moe_ep_block_floats(&cfg, 3, cap, TC), 0); /* 3 does not divide 4 */
    cr_assert_eq(moe_ep_block_floats(&cfg, P, cap, 0), 0);
    float *buf = falloc(P * bf), *y = falloc(TN * TC);
    for (size_t i = 0; i < P * bf; i++)
        buf[i] = NAN; /* every float is written */
    cr_assert_eq(moe_ep_pack(&cfg, &r, P, cap, n.x, buf), 0);
    for (int e = 0; e < cfg.E; e++)
        for (int s = 0; s < cap; s++) {
            const float *row = buf + (size_t)(e / Epr) * bf + ((size_t)(e % Epr) * cap + s) * TC;
            for (int c = 0; c < TC; c++) {
                float want = s < r.count[e] ? n.x[r.slots[e * r.max_N + s].token * TC + c] : 0;
                cr_assert_eq(row[c], want, "expert %d slot %d", e, s);
            }
        }
    /* Experts that return their input: each token gets the sum of its kept weights times x. */
    cr_assert_eq(moe_ep_unpack(&cfg, &r, P, cap, buf, y), 0);
    for (int t = 0; t < TN; t++) {
        double w = r.weight[2 * t] + r.weight[2 * t + 1];
        for (int c = 0; c < TC; c++)
            cr_assert(fabs(y[t * TC + c] - w * n.x[t * TC + c]) <= 1e-6, "token %d", t);
    }
    test_log_capture_start();
    cr_assert_eq(moe_ep_pack(&cfg, &r, P, r.capacity - 1, n.x, buf), -EINVAL);
    cr_assert_not_null(strstr(test_log_text(), "block capacity"));
    cr_assert_eq(moe_ep_unpack(&cfg, &r, 3, cap, buf, y), -EINVAL);
    cr_assert_not_null(strstr(test_log_text(), "ep must divide E"));
    test_log_capture_stop();
    free(buf);
    free(y);
    moe_route_release(&r);
    net_free(&n);
}

/* ---- refusals ------------------------------------------------------------------------------- */

static void refused(int rc, const char *needle)
{
    cr_assert_eq(rc, -EINVAL, "expected -EINVAL for '%s', got %d", needle, rc);
    cr_assert_not_null(strstr(test_log_text(), needle), "no '%s' in the log: %s", needle,
                       test_log_text());
    test_log_capture_start(); /* a fresh log for the next */
}

Test(moe, bad_arguments)
{
    char msg[160];
    struct moe_config c = config(TC, 4, 3, 1.0f, 1);
    cr_assert_eq(moe_config_validate(&c, msg, sizeof(msg)), -EINVAL);
    cr_assert_not_null(strstr(msg, "k=3"), "%s", msg);
    c = config(TC, 1, 2, 1.0f, 1);
    cr_assert_eq(moe_config_validate(&c, msg, sizeof(msg)), -EINVAL);
    cr_assert_not_null(strstr(msg, "E=1"), "%s", msg);
    const float bad_cf[] = {0.0f, -1.0f, NAN, INFINITY};
    for (size_t i = 0; i < 4; i++) {
        c = config(TC, 4, 2, bad_cf[i], 1);
        cr_assert_eq(moe_config_validate(&c, msg, sizeof(msg)), -EINVAL);
        cr_assert_not_null(strstr(msg, "capacity_factor"), "%s", msg);
    }
    c = config(0, 4, 2, 1.0f, 1);
    cr_assert_eq(moe_config_validate(&c, msg, sizeof(msg)), -EINVAL);
    cr_assert_not_null(strstr(msg, "C=0"), "%s", msg);
    cr_assert_eq(moe_config_validate(NULL, msg, sizeof(msg)), -EINVAL);

    test_log_capture_start();
    struct moe_route r;
    c = config(TC, 4, 3, 1.0f, 1);
    refused(moe_route_init(&r, &c, TN), "k=3");
    c = config(TC, 1, 2, 1.0f, 1);
    refused(moe_route_init(&r, &c, TN), "E=1");
    c = config(TC, 4, 2, -0.5f, 1);
    refused(moe_capacity(&c, TN), "capacity_factor");

    struct moe_config cfg = shape_config(0);
    struct net n;
    net_make(&n, &cfg, TN, 1100);
    struct out o;
    out_make(&o, &n);
    refused(moe_route_init(&r, &cfg, 0), "max_N=0");
    cr_assert_eq(moe_route_init(&r, &cfg, TN), 0);
    refused(moe_gate_forward(&cfg, TN, NULL, n.wg, &r), "NULL");
    refused(moe_gate_forward(&cfg, TN + 1, n.x, n.wg, &r), "N=15");
    refused(moe_gate_forward(&cfg, TN, n.x, n.wg, NULL), "no route");
    struct moe_config other = shape_config(4);
    other.C = TC;
    refused(moe_gate_forward(&other, TN, n.x, n.wg, &r), "route was made for E=4");
    refused(moe_expert_forward(&cfg, &r, 0, &n.p[0], n.x, o.y, NULL), "no route");
    cr_assert_eq(moe_gate_forward(&cfg, TN, n.x, n.wg, &r), 0);
    refused(moe_expert_forward(&cfg, &r, 4, &n.p[0], n.x, o.y, NULL), "expert 4");
    struct moe_scratch small = {.mem = msg, .bytes = sizeof(msg)};
    int used[MAXE];
    cr_assert_gt(moe_route_experts_used(&r, used), 0);
    refused(moe_expert_forward(&cfg, &r, used[0], &n.p[used[0]], n.x, o.y, &small), "too small");
    struct moe_expert_params holes = n.p[1];
    holes.proj_b = NULL;
    refused(moe_expert_forward(&cfg, &r, 1, &holes, n.x, o.y, &small), "expert 1");
    refused(moe_expert_backward(&cfg, &r, 1, &n.p[1], NULL, n.x, n.R, o.d_x, o.y, &small),
            "no gradients");
    refused(moe_gate_backward(&cfg, &r, n.x, n.wg, o.y, NAN, o.d_x, o.d_wg, &small), "d_l_aux");
    refused(moe_expert_forward_rows(&cfg, &n.p[0], -1, n.x, o.y, &small), "n=-1");

    struct moe_expert_params with_hole[MAXE];
    memcpy(with_hole, n.p, sizeof(with_hole));
    with_hole[2].fc_w = NULL;
    refused(moe_mlp_forward(&cfg, NULL, TN, n.x, n.wg, with_hole, o.y, &r), "expert 2");
    refused(moe_mlp_forward(&cfg, NULL, 0, n.x, n.wg, n.p, o.y, &r), "N=0");
    refused(moe_mlp_forward(&cfg, NULL, TN, n.x, n.wg, n.p, NULL, &r), "y is NULL");
    struct moe_ep ep = {.ep = 3, .rank = 0, .alltoall = mem_alltoall};
    refused(moe_mlp_forward(&cfg, &ep, TN, n.x, n.wg, n.p, o.y, &r), "ep must divide E");
    ep = (struct moe_ep){.ep = 2, .rank = 2, .alltoall = mem_alltoall};
    refused(moe_mlp_forward(&cfg, &ep, TN, n.x, n.wg, n.p, o.y, &r), "rank 2");
    ep = (struct moe_ep){.ep = 2, .rank = 0};
    refused(moe_mlp_forward(&cfg, &ep, TN, n.x, n.wg, n.p, o.y, &r), "alltoall");
    refused(moe_mlp_backward(&cfg, NULL, TN - 1, n.x, n.wg, n.p, o.eg, &r, n.R, AUX, o.d_x, o.d_wg),
            "holds 14 tokens");
    refused(moe_mlp_backward(&cfg, NULL, TN, n.x, n.wg, n.p, NULL, &r, n.R, AUX, o.d_x, o.d_wg),
            "no expert gradients");
    float w[TC];
    refused(moe_sublock_forward(&cfg, NULL, TN, n.x, NULL, w, n.wg, n.p, o.y, NULL), "NULL");
    refused(moe_sublock_backward(&cfg, NULL, TN, n.x, w, w, n.wg, n.p, n.R, AUX, o.d_x, NULL, w,
                                 o.d_wg, o.eg),
            "NULL");
    test_log_capture_stop();
    moe_route_release(&r);
    out_free(&o);
    net_free(&n);
}
