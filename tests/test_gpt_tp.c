/*
 * test_gpt_tp.c - src/train/gpt_tp.h: the tensor-parallel GPT math against the one-rank
 * math of gpt.h.
 *
 * The tp ranks run as threads of this process, their allreduce and allgather meeting at a
 * barrier and summing (or gathering) in rank order, so a run's bits depend only on the
 * shape and tp. Each rank takes its slices out of the one-rank model's tensors and runs
 * the embedding, one block and the head, forward and backward, on the one-rank run's
 * inputs; its outputs and gradient slices are checked against the one-rank run's (and its
 * slices of the gradients), bit for bit at tp == 1. Also: the slices' round trip, the
 * replicated results being the same bits on every rank, the same bits at 1 and 2 OpenMP
 * threads, how many collectives each call makes, and the refusals.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "train/gpt.h"
#include "train/gpt_tp.h"

#define TB 2 /* batch */
#define TT 7 /* sequence length */
#define TN (TB * TT)
#define MAX_TP 6
#define MAX_C 48
#define MAX_V 256
#define MAX_T 16 /* maxT of the configs */

/* hs = 8 takes the vector attention where the CPU has AVX2, hs = 6 the scalar one. */
static const struct gpt_config cfg61 = {.V = 61, .maxT = MAX_T, .L = 2, .C = 48, .NH = 6};
static const struct gpt_config cfg256 = {.V = 256, .maxT = MAX_T, .L = 2, .C = 48, .NH = 6};
static const struct gpt_config cfg_hs6 = {.V = 61, .maxT = MAX_T, .L = 2, .C = 36, .NH = 6};

TestSuite(gpt_tp, .fini = test_leak_check);

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

static void fill(float *p, size_t n, float scale, uint64_t seed)
{
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        p[i] = scale * urand(&s);
}

static struct gpt_tensor_desc *layout(const struct gpt_config *cfg, int *count)
{
    int n = gpt_layout(cfg, NULL, 0);
    cr_assert_gt(n, 0);
    struct gpt_tensor_desc *d = calloc((size_t)n, sizeof(*d));
    cr_assert_not_null(d);
    cr_assert_eq(gpt_layout(cfg, d, (size_t)n), n);
    *count = n;
    return d;
}

/* max |a - b| <= tol * max |b|, over n. */
static void expect_close(const float *a, const float *b, size_t n, double tol, const char *what,
                         int tp, int rank)
{
    double diff = 0, mag = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > diff || isnan(d)) diff = d;
        if (fabs((double)b[i]) > mag) mag = fabs((double)b[i]);
    }
    cr_expect(diff <= tol * mag, "%s at tp=%d rank %d: max difference %.3g, %.3g of max |%.3g|",
              what, tp, rank, diff, mag > 0 ? diff / mag : diff, mag);
}

/* ---- ranks as threads ------------------------------------------------------------------ */

/* The collectives of tp threads: each posts its buffer, all meet at the barrier, each sums
 * (gathers) the posted buffers in rank order into its own copy, all meet again (no buffer
 * is read any more), and each writes its copy back. The same bits on every rank. */
struct group {
    int tp;
    pthread_barrier_t bar;
    const float *posted[MAX_TP];
};

struct rank_ctx {
    struct group *g;
    int rank;
    int allreduces, allgathers; /* calls so far */
};

static int sim_allreduce(void *ctx, float *buf, size_t count)
{
    struct rank_ctx *c = ctx;
    struct group *g = c->g;
    float *sum = malloc(count * sizeof(float));
    if (!sum) return -ENOMEM; /* unreachable in these sizes; the others would wait */
    c->allreduces++;
    g->posted[c->rank] = buf;
    pthread_barrier_wait(&g->bar);
    for (size_t i = 0; i < count; i++) {
        float s = g->posted[0][i];
        for (int r = 1; r < g->tp; r++)
            s += g->posted[r][i];
        sum[i] = s;
    }
    pthread_barrier_wait(&g->bar);
    memcpy(buf, sum, count * sizeof(float));
    free(sum);
    return 0;
}

static int sim_allgather(void *ctx, const float *send, float *recv, size_t count)
{
    struct rank_ctx *c = ctx;
    struct group *g = c->g;
    c->allgathers++;
    g->posted[c->rank] = send;
    pthread_barrier_wait(&g->bar);
    for (int r = 0; r < g->tp; r++)
        memcpy(recv + (size_t)r * count, g->posted[r], count * sizeof(float));
    pthread_barrier_wait(&g->bar);
    return 0;
}

/* The one-rank model's tensors and every piece's inputs, shared read-only by the ranks. */
struct inputs {
    const struct gpt_config *cfg;
    struct gpt_tensor_desc *desc;
    int ndesc;
    float *params, *grads0; /* gpt_num_params(); grads0: what the gradients start from */
    int tokens[TN], targets[TN];
    float x_blk[TN * MAX_C], d_blk[TN * MAX_C];  /* the block's input and d_out */
    float x_head[TN * MAX_C], d_emb[TN * MAX_C]; /* the head's input, the embedding's d_x */
};

/* One rank's (or the one-rank run's) results: the replicated ones whole, the rest sliced. */
struct results {
    float x_emb[TN * MAX_C], x_blk[TN * MAX_C], logits[TN * MAX_V];
    float d_xh[TN * MAX_C], d_lnf_w[MAX_C], d_lnf_b[MAX_C], d_wte_h[MAX_V * MAX_C];
    float d_in[TN * MAX_C], g_blk[12 * MAX_C * MAX_C + 13 * MAX_C];
    float d_wte_e[MAX_V * MAX_C], d_wpe[MAX_T * MAX_C];
    float loss_f, loss_b;
    /* collectives per call: embed fwd, bwd, block fwd, bwd, head fwd, bwd */
    int allreduces[6], allgathers[6];
    int rc;
};

static const struct gpt_tensor_desc *find(const struct inputs *in, int block, int slot)
{
    for (int i = 0; i < in->ndesc; i++)
        if (in->desc[i].block == block && in->desc[i].slot == slot) return &in->desc[i];
    cr_assert_fail("no tensor (%d, %d)", block, slot);
    return NULL;
}

struct rank_job {
    const struct inputs *in;
    struct group *g;
    struct rank_ctx ctx;
    int nthreads;
    struct results *out;
};

/* Rank's whole run; 0 or the first negative return. No assertions: it is not the test's
 * thread. */
static int run_rank(struct rank_job *j)
{
    const struct inputs *in = j->in;
    const struct gpt_config *cfg = in->cfg;
    struct results *o = j->out;
    int tp = j->g->tp, rank = j->ctx.rank, r;
    struct gpt_tp_comm comm = {.tp = tp,
                               .rank = rank,
                               .allreduce = sim_allreduce,
                               .allgather = sim_allgather,
                               .ctx = &j->ctx};
    size_t C = (size_t)cfg->C, maxT = (size_t)cfg->maxT, shape[2];
    size_t nblk = gpt_tp_block_num_params(cfg, tp, rank);
    const struct gpt_tensor_desc *dwte = find(in, -1, GPT_WTE);
    gpt_tp_tensor_shape(cfg, tp, rank, dwte, shape);
    size_t wte_n = shape[0] * shape[1];
    struct gpt_scratch s = {.bytes = gpt_tp_scratch_bytes(cfg, tp, TB, TT)};
    float *blk = malloc(nblk * sizeof(float)), *wte = malloc(wte_n * sizeof(float));
    s.mem = malloc(s.bytes);
    if (!blk || !wte || !s.mem) {
        r = -ENOMEM;
        goto out;
    }
    /* This rank's slices of the parameters and of the gradients' starting values. */
    struct gpt_block_params p;
    struct gpt_block_grads g;
    gpt_tp_block_params_at(cfg, tp, rank, blk, &p);
    gpt_tp_block_grads_at(cfg, tp, rank, o->g_blk, &g);
    for (int sl = 0; sl < GPT_BLOCK_NSLOTS; sl++) {
        const struct gpt_tensor_desc *d = find(in, 0, sl);
        float *pt = blk + (p.t[sl] - blk); /* the slot's place in blk, writable */
        if ((r = gpt_tp_slice_out(cfg, tp, rank, d, in->params + d->offset, pt)) < 0 ||
            (r = gpt_tp_slice_out(cfg, tp, rank, d, in->grads0 + d->offset, g.t[sl])) < 0)
            goto out;
    }
    const float *wpe = in->params + find(in, -1, GPT_WPE)->offset;
    const float *lnf_w = in->params + find(in, -1, GPT_LNF_W)->offset;
    const float *lnf_b = in->params + find(in, -1, GPT_LNF_B)->offset;
    if ((r = gpt_tp_slice_out(cfg, tp, rank, dwte, in->params + dwte->offset, wte)) < 0 ||
        (r = gpt_tp_slice_out(cfg, tp, rank, dwte, in->grads0 + dwte->offset, o->d_wte_h)) < 0 ||
        (r = gpt_tp_slice_out(cfg, tp, rank, dwte, in->grads0 + dwte->offset, o->d_wte_e)) < 0)
        goto out;
    memcpy(o->d_wpe, in->grads0 + find(in, -1, GPT_WPE)->offset, maxT * C * sizeof(float));
    memcpy(o->d_lnf_w, in->grads0 + find(in, -1, GPT_LNF_W)->offset, C * sizeof(float));
    memcpy(o->d_lnf_b, in->grads0 + find(in, -1, GPT_LNF_B)->offset, C * sizeof(float));

    int k = 0;
#define COUNTED(call)                                                                              \
    do {                                                                                           \
        int ar = j->ctx.allreduces, ag = j->ctx.allgathers;                                        \
        if ((r = (call)) < 0) goto out;                                                            \
        o->allreduces[k] = j->ctx.allreduces - ar;                                                 \
        o->allgathers[k++] = j->ctx.allgathers - ag;                                               \
    } while (0)
    COUNTED(gpt_tp_embed_forward(cfg, &comm, TB, TT, wte, wpe, in->tokens, o->x_emb));
    COUNTED(gpt_tp_embed_backward(cfg, &comm, TB, TT, in->tokens, in->d_emb, o->d_wte_e, o->d_wpe));
    COUNTED(gpt_tp_block_forward(cfg, &comm, TB, TT, &p, in->x_blk, o->x_blk, &s));
    COUNTED(gpt_tp_block_backward(cfg, &comm, TB, TT, &p, in->x_blk, in->d_blk, o->d_in, &g, &s));
    COUNTED(gpt_tp_head_forward(cfg, &comm, TB, TT, lnf_w, lnf_b, wte, in->x_head, in->targets,
                                &o->loss_f, o->logits, &s));
    COUNTED(gpt_tp_head_backward(cfg, &comm, TB, TT, lnf_w, lnf_b, wte, in->x_head, in->targets,
                                 o->d_xh, o->d_lnf_w, o->d_lnf_b, o->d_wte_h, &o->loss_b, &s));
#undef COUNTED
    r = 0;
out:
    free(s.mem);
    free(wte);
    free(blk);
    return r;
}

static void *rank_main(void *arg)
{
    struct rank_job *j = arg;
    omp_set_num_threads(j->nthreads); /* this thread's OpenMP teams */
    j->out->rc = run_rank(j);
    return NULL;
}

/* Runs tp ranks at nthreads OpenMP threads each; out[rank] receives their results. */
static void run_tp(const struct inputs *in, int tp, int nthreads, struct results **out)
{
    struct group g = {.tp = tp};
    struct rank_job jobs[MAX_TP];
    pthread_t th[MAX_TP];
    cr_assert_eq(pthread_barrier_init(&g.bar, NULL, (unsigned)tp), 0);
    for (int r = 0; r < tp; r++) {
        out[r] = calloc(1, sizeof(struct results));
        cr_assert_not_null(out[r]);
        jobs[r] = (struct rank_job){
            .in = in, .g = &g, .ctx = {.g = &g, .rank = r}, .nthreads = nthreads, .out = out[r]};
        cr_assert_eq(pthread_create(&th[r], NULL, rank_main, &jobs[r]), 0);
    }
    for (int r = 0; r < tp; r++)
        pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g.bar);
    for (int r = 0; r < tp; r++)
        cr_assert_eq(out[r]->rc, 0, "rank %d of tp=%d failed: %d", r, tp, out[r]->rc);
}

/* ---- the one-rank reference ------------------------------------------------------------ */

static void make_inputs(struct inputs *in, const struct gpt_config *cfg, uint64_t seed)
{
    memset(in, 0, sizeof(*in));
    in->cfg = cfg;
    in->desc = layout(cfg, &in->ndesc);
    size_t n = gpt_num_params(cfg), NC = (size_t)TN * (size_t)cfg->C;
    in->params = falloc(n);
    in->grads0 = falloc(n);
    cr_assert_eq(gpt_model_init(cfg, in->params, seed), 0);
    /* Move every value (LayerNorms and biases too) so that no gradient is zero by symmetry;
     * the gradients start small and nonzero, to see that they accumulate. */
    uint64_t s = seed * 7 + 1;
    for (size_t i = 0; i < n; i++)
        in->params[i] += 0.3f * urand(&s);
    fill(in->grads0, n, 1e-3f, seed + 2);
    for (int i = 0; i < TN; i++) {
        in->tokens[i] = (int)(test_rand(&s) % (uint64_t)cfg->V);
        in->targets[i] = (int)(test_rand(&s) % (uint64_t)cfg->V);
    }
    fill(in->x_blk, NC, 1.0f, seed + 3);
    fill(in->d_blk, NC, 0.1f, seed + 4);
    fill(in->x_head, NC, 1.0f, seed + 5);
    fill(in->d_emb, NC, 0.1f, seed + 6);
}

static void free_inputs(struct inputs *in)
{
    free(in->desc);
    free(in->params);
    free(in->grads0);
}

/* The one-rank run through gpt.h, its gradients in a whole-model buffer (*grads). */
static void run_ref(const struct inputs *in, struct results *o, float **grads)
{
    const struct gpt_config *cfg = in->cfg;
    size_t n = gpt_num_params(cfg);
    float *gr = falloc(n);
    memcpy(gr, in->grads0, n * sizeof(float));
    struct gpt_scratch s = {.bytes = gpt_scratch_bytes(cfg, TB, TT)};
    s.mem = malloc(s.bytes);
    cr_assert_not_null(s.mem);
    const float *wte = in->params + find(in, -1, GPT_WTE)->offset;
    const float *wpe = in->params + find(in, -1, GPT_WPE)->offset;
    const float *lnf_w = in->params + find(in, -1, GPT_LNF_W)->offset;
    const float *lnf_b = in->params + find(in, -1, GPT_LNF_B)->offset;
    float *g_wte_e = falloc((size_t)cfg->V * cfg->C); /* the embedding's d_wte apart */
    memcpy(g_wte_e, in->grads0 + find(in, -1, GPT_WTE)->offset,
           (size_t)cfg->V * cfg->C * sizeof(float));
    struct gpt_block_params p;
    struct gpt_block_grads g;
    gpt_block_params_at(cfg, in->params + find(in, 0, 0)->offset, &p);
    gpt_block_grads_at(cfg, gr + find(in, 0, 0)->offset, &g);
    cr_assert_eq(gpt_embed_forward(cfg, TB, TT, wte, wpe, in->tokens, o->x_emb), 0);
    cr_assert_eq(gpt_embed_backward(cfg, TB, TT, in->tokens, in->d_emb, g_wte_e,
                                    gr + find(in, -1, GPT_WPE)->offset),
                 0);
    cr_assert_eq(gpt_block_forward(cfg, TB, TT, &p, in->x_blk, o->x_blk, &s), 0);
    cr_assert_eq(gpt_block_backward(cfg, TB, TT, &p, in->x_blk, in->d_blk, o->d_in, &g, &s), 0);
    cr_assert_eq(gpt_head_forward(cfg, TB, TT, lnf_w, lnf_b, wte, in->x_head, in->targets,
                                  &o->loss_f, o->logits, &s),
                 0);
    cr_assert_eq(gpt_head_backward(cfg, TB, TT, lnf_w, lnf_b, wte, in->x_head, in->targets, o->d_xh,
                                   gr + find(in, -1, GPT_LNF_W)->offset,
                                   gr + find(in, -1, GPT_LNF_B)->offset,
                                   gr + find(in, -1, GPT_WTE)->offset, &o->loss_b, &s),
                 0);
    memcpy(o->d_wte_e, g_wte_e, (size_t)cfg->V * cfg->C * sizeof(float));
    free(g_wte_e);
    free(s.mem);
    *grads = gr;
}

/* ---- the comparisons -------------------------------------------------------------------- */

#define TOL 1e-5      /* tensors: of their largest magnitude */
#define LOSS_TOL 1e-6 /* the loss: relative */

static int replicated_slot(int slot)
{
    return slot == GPT_LN1_W || slot == GPT_LN1_B || slot == GPT_ATTN_PROJ_B || slot == GPT_LN2_W ||
           slot == GPT_LN2_B || slot == GPT_MLP_PROJ_B;
}

/* Rank's results against the one-rank run's (ref, whole-model gradients gr). */
static void check_rank(const struct inputs *in, int tp, int rank, const struct results *o,
                       const struct results *ref, const float *gr)
{
    const struct gpt_config *cfg = in->cfg;
    size_t C = (size_t)cfg->C, V = (size_t)cfg->V, NC = TN * C, maxT = (size_t)cfg->maxT;
    int lo, hi;
    cr_assert_eq(gpt_tp_vocab_range(cfg, tp, rank, &lo, &hi), 0);
    cr_assert_eq(lo, (int)(V * (size_t)rank / (size_t)tp));
    cr_assert_eq(hi, (int)(V * (size_t)(rank + 1) / (size_t)tp));
    size_t Vr = (size_t)(hi - lo);
    const struct gpt_tensor_desc *dwte = find(in, -1, GPT_WTE);
    float *want = falloc(V * C), *slice = falloc(12 * C * C + 13 * C);

    /* The embedding is exact at every tp: one rank's value plus zeros, and the one-rank
     * order of the sums over (b,t). */
    cr_expect_eq(memcmp(o->x_emb, ref->x_emb, NC * sizeof(float)), 0, "x at tp=%d", tp);
    cr_expect_eq(memcmp(o->d_wpe, gr + find(in, -1, GPT_WPE)->offset, maxT * C * sizeof(float)), 0,
                 "embedding d_wpe at tp=%d", tp);
    cr_assert_eq(gpt_tp_slice_out(cfg, tp, rank, dwte, ref->d_wte_e, want), 0);
    cr_expect_eq(memcmp(o->d_wte_e, want, Vr * C * sizeof(float)), 0, "embedding d_wte at tp=%d",
                 tp);

    /* The block. */
    expect_close(o->x_blk, ref->x_blk, NC, TOL, "block x_out", tp, rank);
    expect_close(o->d_in, ref->d_in, NC, TOL, "block d_in", tp, rank);
    struct gpt_block_grads g;
    cr_assert_eq(gpt_tp_block_grads_at(cfg, tp, rank, (float *)o->g_blk, &g), 0);
    for (int sl = 0; sl < GPT_BLOCK_NSLOTS; sl++) {
        const struct gpt_tensor_desc *d = find(in, 0, sl);
        size_t shape[2];
        cr_assert_eq(gpt_tp_block_slot_shape(cfg, tp, rank, sl, shape), 0);
        cr_assert_eq(gpt_tp_slice_out(cfg, tp, rank, d, gr + d->offset, slice), 0);
        char what[64];
        snprintf(what, sizeof(what), "gradient of %s", gpt_block_slot_name(sl));
        expect_close(g.t[sl], slice, shape[0] * shape[1], TOL, what, tp, rank);
    }

    /* The head. */
    cr_expect(fabs((double)o->loss_f - ref->loss_f) <= LOSS_TOL * fabs((double)ref->loss_f),
              "head loss at tp=%d: %.9g, one rank %.9g", tp, o->loss_f, ref->loss_f);
    cr_expect(fabs((double)o->loss_b - ref->loss_b) <= LOSS_TOL * fabs((double)ref->loss_b),
              "head backward's loss at tp=%d: %.9g, one rank %.9g", tp, o->loss_b, ref->loss_b);
    for (size_t n = 0; n < TN; n++)
        memcpy(want + n * Vr, ref->logits + n * V + lo, Vr * sizeof(float));
    expect_close(o->logits, want, TN * Vr, TOL, "logits", tp, rank);
    expect_close(o->d_xh, ref->d_xh, NC, TOL, "head d_x", tp, rank);
    expect_close(o->d_lnf_w, gr + find(in, -1, GPT_LNF_W)->offset, C, TOL, "d_lnf_w", tp, rank);
    expect_close(o->d_lnf_b, gr + find(in, -1, GPT_LNF_B)->offset, C, TOL, "d_lnf_b", tp, rank);
    cr_assert_eq(gpt_tp_slice_out(cfg, tp, rank, dwte, gr + dwte->offset, want), 0);
    expect_close(o->d_wte_h, want, Vr * C, TOL, "head d_wte", tp, rank);

    /* Collectives per call: none at tp == 1; the block's forward two, its backward one to
     * recompute and Megatron's two; the head's one gather of maxima and one allreduce of
     * the softmax's sums, and in the backward one more for lnf's input gradient. */
    static const int ar[6] = {1, 0, 2, 3, 1, 2}, ag[6] = {0, 0, 0, 0, 1, 1};
    for (int k = 0; k < 6; k++) {
        cr_expect_eq(o->allreduces[k], tp > 1 ? ar[k] : 0, "call %d at tp=%d: %d allreduces", k, tp,
                     o->allreduces[k]);
        cr_expect_eq(o->allgathers[k], tp > 1 ? ag[k] : 0, "call %d at tp=%d: %d allgathers", k, tp,
                     o->allgathers[k]);
    }
    free(slice);
    free(want);
}

/* What every rank holds whole is the same bits on every rank. */
static void check_replicated(const struct inputs *in, int tp, struct results **o)
{
    size_t C = (size_t)in->cfg->C, NC = TN * C;
    for (int r = 1; r < tp; r++) {
        cr_expect_eq(memcmp(o[r]->x_emb, o[0]->x_emb, NC * sizeof(float)), 0);
        cr_expect_eq(memcmp(o[r]->x_blk, o[0]->x_blk, NC * sizeof(float)), 0);
        cr_expect_eq(memcmp(o[r]->d_in, o[0]->d_in, NC * sizeof(float)), 0);
        cr_expect_eq(memcmp(o[r]->d_xh, o[0]->d_xh, NC * sizeof(float)), 0);
        cr_expect_eq(memcmp(o[r]->d_lnf_w, o[0]->d_lnf_w, C * sizeof(float)), 0);
        cr_expect_eq(memcmp(o[r]->d_lnf_b, o[0]->d_lnf_b, C * sizeof(float)), 0);
        cr_expect_eq(memcmp(o[r]->d_wpe, o[0]->d_wpe, sizeof(o[0]->d_wpe)), 0);
        cr_expect_eq(memcmp(&o[r]->loss_f, &o[0]->loss_f, sizeof(float)), 0);
        cr_expect_eq(memcmp(&o[r]->loss_b, &o[0]->loss_b, sizeof(float)), 0);
        struct gpt_block_grads g0, gr;
        gpt_tp_block_grads_at(in->cfg, tp, 0, o[0]->g_blk, &g0);
        gpt_tp_block_grads_at(in->cfg, tp, r, o[r]->g_blk, &gr);
        for (int sl = 0; sl < GPT_BLOCK_NSLOTS; sl++)
            if (replicated_slot(sl))
                cr_expect_eq(memcmp(gr.t[sl], g0.t[sl], C * sizeof(float)), 0,
                             "%s's gradient on rank %d of tp=%d", gpt_block_slot_name(sl), r, tp);
    }
}

static void free_results(struct results **o, int tp)
{
    for (int r = 0; r < tp; r++)
        free(o[r]);
}

/* Every tp of tps against the one-rank run; tp == 1 to the bit. */
static void check_config(const struct gpt_config *cfg, const int *tps, int ntps, uint64_t seed)
{
    struct inputs *in = calloc(1, sizeof(*in));
    struct results *ref = calloc(1, sizeof(*ref));
    cr_assert(in && ref);
    make_inputs(in, cfg, seed);
    float *gr;
    run_ref(in, ref, &gr);
    for (int i = 0; i < ntps; i++) {
        int tp = tps[i];
        struct results *o[MAX_TP];
        run_tp(in, tp, 2, o);
        for (int r = 0; r < tp; r++)
            check_rank(in, tp, r, o[r], ref, gr);
        check_replicated(in, tp, o);
        if (tp == 1) {
            /* gpt.c's bits: the whole results, and the whole block's gradients. */
            size_t C = (size_t)cfg->C, NC = TN * C, V = (size_t)cfg->V;
            cr_expect_eq(memcmp(o[0]->x_blk, ref->x_blk, NC * sizeof(float)), 0);
            cr_expect_eq(memcmp(o[0]->d_in, ref->d_in, NC * sizeof(float)), 0);
            cr_expect_eq(memcmp(o[0]->logits, ref->logits, TN * V * sizeof(float)), 0);
            cr_expect_eq(memcmp(o[0]->d_xh, ref->d_xh, NC * sizeof(float)), 0);
            cr_expect_eq(memcmp(&o[0]->loss_f, &ref->loss_f, sizeof(float)), 0);
            cr_expect_eq(memcmp(&o[0]->loss_b, &ref->loss_b, sizeof(float)), 0);
            cr_expect_eq(memcmp(o[0]->g_blk, gr + find(in, 0, 0)->offset,
                                gpt_block_num_params(cfg) * sizeof(float)),
                         0, "the block's gradients at tp=1");
            cr_expect_eq(
                memcmp(o[0]->d_lnf_w, gr + find(in, -1, GPT_LNF_W)->offset, C * sizeof(float)), 0);
            cr_expect_eq(
                memcmp(o[0]->d_lnf_b, gr + find(in, -1, GPT_LNF_B)->offset, C * sizeof(float)), 0);
            cr_expect_eq(
                memcmp(o[0]->d_wte_h, gr + find(in, -1, GPT_WTE)->offset, V * C * sizeof(float)),
                0);
        }
        free_results(o, tp);
    }
    free(gr);
    free(ref);
    free_inputs(in);
    free(in);
}

static const int all_tps[] = {1, 2, 3, 6};

Test(gpt_tp, matches_one_rank_uneven_vocab)
{
    check_config(&cfg61, all_tps, 4, 11); /* 61 rows: 30+31, 20+20+21, 10 x5 + 11 */
}

Test(gpt_tp, matches_one_rank_byte_vocab)
{
    check_config(&cfg256, all_tps, 4, 12); /* 256 rows: tp=3 gives 85, 85, 86 */
}

Test(gpt_tp, matches_one_rank_scalar_attention)
{
    check_config(&cfg_hs6, all_tps, 4, 13); /* heads of 6 channels: the scalar attention */
}

/* The same bits whatever the OpenMP thread count, and run to run. */
Test(gpt_tp, same_bits_at_any_thread_count)
{
    struct inputs *in = calloc(1, sizeof(*in));
    cr_assert_not_null(in);
    make_inputs(in, &cfg256, 21);
    const int tps[] = {2, 3};
    for (int i = 0; i < 2; i++) {
        int tp = tps[i];
        struct results *a[MAX_TP], *b[MAX_TP], *c[MAX_TP];
        run_tp(in, tp, 1, a);
        run_tp(in, tp, 2, b);
        run_tp(in, tp, 2, c);
        for (int r = 0; r < tp; r++) {
            cr_expect_eq(memcmp(a[r], b[r], sizeof(*a[r])), 0,
                         "rank %d of tp=%d: 1 and 2 threads differ", r, tp);
            cr_expect_eq(memcmp(b[r], c[r], sizeof(*b[r])), 0,
                         "rank %d of tp=%d: two runs at 2 threads differ", r, tp);
        }
        free_results(a, tp);
        free_results(b, tp);
        free_results(c, tp);
    }
    free_inputs(in);
    free(in);
}

/* ---- the cut ------------------------------------------------------------------------------ */

/* Every tensor sliced out by every rank and scattered back is the whole tensor again; the
 * split ones' slices add up to it, each element on one rank. */
Test(gpt_tp, slices_round_trip)
{
    const struct gpt_config *cfg = &cfg61;
    int n;
    struct gpt_tensor_desc *d = layout(cfg, &n);
    for (int t = 0; t < 4; t++) {
        int tp = all_tps[t];
        for (int i = 0; i < n; i++) {
            float *full = falloc(d[i].numel), *back = falloc(d[i].numel);
            float *slice = falloc(d[i].numel);
            fill(full, d[i].numel, 1.0f, (uint64_t)i + 1);
            for (size_t k = 0; k < d[i].numel; k++)
                back[k] = NAN; /* what no rank scatters stays NaN */
            size_t total = 0;
            for (int r = 0; r < tp; r++) {
                size_t shape[2];
                cr_assert_eq(gpt_tp_tensor_shape(cfg, tp, r, &d[i], shape), 0);
                cr_assert_eq(gpt_tp_slice_out(cfg, tp, r, &d[i], full, slice), 0);
                cr_assert_eq(gpt_tp_slice_in(cfg, tp, r, &d[i], slice, back), 0);
                total += shape[0] * shape[1];
                if (d[i].block >= 0) {
                    size_t bs[2];
                    cr_assert_eq(gpt_tp_block_slot_shape(cfg, tp, r, d[i].slot, bs), 0);
                    cr_assert(bs[0] == shape[0] && bs[1] == shape[1]);
                }
            }
            cr_expect_eq(memcmp(full, back, d[i].numel * sizeof(float)), 0, "%s at tp=%d",
                         d[i].name, tp);
            int split = d[i].block >= 0 ? !replicated_slot(d[i].slot) : d[i].slot == GPT_WTE;
            cr_expect_eq(total, split ? d[i].numel : (size_t)tp * d[i].numel,
                         "%s at tp=%d: %zu floats over the ranks", d[i].name, tp, total);
            free(slice);
            free(back);
            free(full);
        }
    }
    free(d);
}

/* A checkpoint's re-cut: every tensor cut over tp A, put back whole from A's slices (each
 * rank's slice_in in turn, the replicated tensors' copies identical) and cut over tp B,
 * gives B's slices of the tensor bitwise, for every A, B of all_tps. */
Test(gpt_tp, slices_recut_from_one_tp_to_another)
{
    const struct gpt_config *cfg = &cfg61;
    int n;
    struct gpt_tensor_desc *d = layout(cfg, &n);
    for (int i = 0; i < n; i++) {
        float *full = falloc(d[i].numel), *back = falloc(d[i].numel);
        float *slice = falloc(d[i].numel), *want = falloc(d[i].numel);
        fill(full, d[i].numel, 1.0f, (uint64_t)i + 7);
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 4; b++) {
                int ta = all_tps[a], tb = all_tps[b];
                for (size_t k = 0; k < d[i].numel; k++)
                    back[k] = NAN;
                for (int r = 0; r < ta; r++) {
                    cr_assert_eq(gpt_tp_slice_out(cfg, ta, r, &d[i], full, slice), 0);
                    cr_assert_eq(gpt_tp_slice_in(cfg, ta, r, &d[i], slice, back), 0);
                }
                for (int r = 0; r < tb; r++) {
                    size_t shape[2];
                    cr_assert_eq(gpt_tp_tensor_shape(cfg, tb, r, &d[i], shape), 0);
                    cr_assert_eq(gpt_tp_slice_out(cfg, tb, r, &d[i], back, slice), 0);
                    cr_assert_eq(gpt_tp_slice_out(cfg, tb, r, &d[i], full, want), 0);
                    cr_expect_eq(memcmp(slice, want, shape[0] * shape[1] * sizeof(float)), 0,
                                 "%s: tp %d -> tp %d, rank %d", d[i].name, ta, tb, r);
                }
            }
        free(want);
        free(slice);
        free(back);
        free(full);
    }
    free(d);
}

/* Which rows and columns a rank holds, for the tensors whose cut is not one range. */
Test(gpt_tp, slices_hold_the_ranks_heads)
{
    const struct gpt_config *cfg = &cfg61;
    size_t C = 48, Cr = 16; /* tp = 3 */
    int n;
    struct gpt_tensor_desc *d = layout(cfg, &n);
    const struct gpt_tensor_desc *qkv = NULL, *proj = NULL, *mproj = NULL;
    for (int i = 0; i < n; i++) {
        if (d[i].block != 1) continue;
        if (d[i].slot == GPT_QKV_W) qkv = &d[i];
        if (d[i].slot == GPT_ATTN_PROJ_W) proj = &d[i];
        if (d[i].slot == GPT_MLP_PROJ_W) mproj = &d[i];
    }
    cr_assert(qkv && proj && mproj);
    float *full = falloc(4 * C * C), *slice = falloc(4 * C * C);
    for (size_t k = 0; k < 4 * C * C; k++)
        full[k] = (float)k;
    /* Rank 2's k rows: the second third of its slice, from row C + 2 Cr of the whole. */
    cr_assert_eq(gpt_tp_slice_out(cfg, 3, 2, qkv, full, slice), 0);
    cr_expect_eq(slice[Cr * C], full[(C + 2 * Cr) * C]);
    cr_expect_eq(slice[3 * Cr * C - 1], full[3 * C * C - 1]);
    /* Rank 1's columns of attn.proj.w: row 5, its column 3 is the whole's column Cr + 3. */
    cr_assert_eq(gpt_tp_slice_out(cfg, 3, 1, proj, full, slice), 0);
    cr_expect_eq(slice[5 * Cr + 3], full[5 * C + Cr + 3]);
    /* Rank 1's columns of mlp.proj.w (C, 4C): row 7, column 0 is the whole's 4 Cr. */
    cr_assert_eq(gpt_tp_slice_out(cfg, 3, 1, mproj, full, slice), 0);
    cr_expect_eq(slice[7 * 4 * Cr], full[7 * 4 * C + 4 * Cr]);
    free(slice);
    free(full);
    free(d);
}

Test(gpt_tp, block_num_params)
{
    const struct gpt_config *cfg = &cfg256;
    size_t C = (size_t)cfg->C;
    cr_expect_eq(gpt_tp_block_num_params(cfg, 1, 0), gpt_block_num_params(cfg));
    for (int t = 0; t < 4; t++) {
        size_t tp = (size_t)all_tps[t];
        for (int r = 0; r < (int)tp; r++)
            cr_expect_eq(gpt_tp_block_num_params(cfg, (int)tp, r),
                         12 * C * C / tp + 7 * C / tp + 6 * C, "tp=%zu", tp);
    }
    cr_expect_eq(gpt_tp_block_num_params(cfg, 4, 0), 0);
}

/* ---- refusals ----------------------------------------------------------------------------- */

Test(gpt_tp, refuses_heads_not_multiple_of_tp)
{
    char msg[160];
    cr_assert_eq(gpt_tp_validate(&cfg61, 4, 0, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "NH=6") && strstr(msg, "tp=4"), "message: %s", msg);
    cr_assert_eq(gpt_tp_validate(&cfg61, 3, 2, msg, sizeof(msg)), 0);
    cr_expect_eq(msg[0], '\0');
    cr_expect_eq(gpt_tp_scratch_bytes(&cfg61, 4, TB, TT), 0);
    size_t shape[2];
    cr_expect_eq(gpt_tp_block_slot_shape(&cfg61, 4, 0, GPT_QKV_W, shape), -EINVAL);
    struct gpt_tp_comm comm = {
        .tp = 4, .rank = 0, .allreduce = sim_allreduce, .allgather = sim_allgather};
    float x[TN * MAX_C] = {0};
    int tok[TN] = {0};
    cr_expect_eq(gpt_tp_embed_forward(&cfg61, &comm, TB, TT, x, x, tok, x), -EINVAL);
}

Test(gpt_tp, refuses_bad_input)
{
    char msg[160];
    const struct gpt_config *cfg = &cfg61;
    cr_expect_eq(gpt_tp_validate(cfg, 0, 0, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "tp=0"), "message: %s", msg);
    cr_expect_eq(gpt_tp_validate(cfg, 2, 2, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "rank=2"), "message: %s", msg);
    cr_expect_eq(gpt_tp_validate(cfg, 2, -1, NULL, 0), -EINVAL);
    struct gpt_config small_v = {.V = 3, .maxT = 8, .L = 1, .C = 12, .NH = 6};
    cr_expect_eq(gpt_tp_validate(&small_v, 6, 0, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "V=3") && strstr(msg, "tp=6"), "message: %s", msg);
    struct gpt_config bad = cfg61;
    bad.C = 50;
    cr_expect_eq(gpt_tp_validate(&bad, 1, 0, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "C=50"), "message: %s", msg);

    /* A description that is not the model's tensor. */
    int n;
    struct gpt_tensor_desc *d = layout(cfg, &n);
    struct gpt_tensor_desc wrong = d[2]; /* h0.ln1.w */
    wrong.shape[0]++;
    wrong.numel++;
    float buf[64 * MAX_C];
    size_t shape[2];
    cr_expect_eq(gpt_tp_slice_out(cfg, 2, 0, &wrong, buf, buf), -EINVAL);
    cr_expect_eq(gpt_tp_tensor_shape(cfg, 2, 0, &wrong, shape), -EINVAL);
    wrong = d[2];
    wrong.block = cfg->L;
    cr_expect_eq(gpt_tp_slice_in(cfg, 2, 0, &wrong, buf, buf), -EINVAL);
    cr_expect_eq(gpt_tp_slice_out(cfg, 2, 0, &d[2], NULL, buf), -EINVAL);
    cr_expect_eq(gpt_tp_slice_in(cfg, 2, 0, &d[2], NULL, buf), -EINVAL);
    cr_expect_eq(gpt_tp_slice_in(cfg, 2, 0, &d[2], buf, NULL), -EINVAL);
    cr_expect_eq(gpt_tp_slice_in(cfg, 4, 0, &d[2], buf, buf), -EINVAL); /* NH 6 over 4 */
    cr_expect_eq(gpt_tp_block_slot_shape(cfg, 2, 0, GPT_BLOCK_NSLOTS, shape), -EINVAL);
    free(d);

    /* Calls: collectives missing at tp > 1, scratch too small, a token out of range. */
    float *x = falloc(TN * MAX_C), *y = falloc(TN * MAX_C), *w = falloc(MAX_V * MAX_C);
    int tok[TN] = {0};
    struct gpt_tp_comm none = {.tp = 2, .rank = 0};
    cr_expect_eq(gpt_tp_embed_forward(cfg, &none, TB, TT, w, w, tok, x), -EINVAL);
    cr_expect_eq(gpt_tp_embed_forward(cfg, NULL, TB, TT, w, w, tok, x), -EINVAL);
    struct gpt_tp_comm one = {.tp = 1, .rank = 0};
    tok[3] = cfg->V;
    cr_expect_eq(gpt_tp_embed_forward(cfg, &one, TB, TT, w, w, tok, x), -EINVAL);
    cr_expect_eq(gpt_tp_embed_backward(cfg, &one, TB, TT, tok, x, w, w), -EINVAL);
    tok[3] = 0;
    cr_expect_eq(gpt_tp_embed_forward(cfg, &one, TB, MAX_T + 1, w, w, tok, x), -EINVAL);
    struct gpt_scratch s = {.bytes = gpt_tp_scratch_bytes(cfg, 1, TB, TT) - 1};
    s.mem = malloc(s.bytes);
    cr_assert_not_null(s.mem);
    float *blk = falloc(gpt_tp_block_num_params(cfg, 1, 0));
    struct gpt_block_params p;
    cr_assert_eq(gpt_tp_block_params_at(cfg, 1, 0, blk, &p), 0);
    cr_expect_eq(gpt_tp_block_forward(cfg, &one, TB, TT, &p, x, y, &s), -EINVAL);
    cr_expect_eq(gpt_tp_head_forward(cfg, &one, TB, TT, w, w, w, x, tok, NULL, NULL, &s), -EINVAL);
    s.bytes++;
    struct gpt_block_grads g;
    cr_assert_eq(gpt_tp_block_grads_at(cfg, 1, 0, blk, &g), 0);
    cr_expect_eq(gpt_tp_block_backward(cfg, &one, TB, TT, &p, x, y, (float *)x, &g, &s), -EINVAL,
                 "d_in must not be x_in");
    cr_expect_eq(gpt_tp_head_backward(cfg, &one, TB, TT, w, w, w, x, tok, NULL, w, w, w, NULL, &s),
                 -EINVAL);
    tok[0] = -1;
    cr_expect_eq(gpt_tp_head_forward(cfg, &one, TB, TT, w, w, w, x, tok, &w[0], NULL, &s), -EINVAL);
    float *logits = falloc(TN * MAX_V);
    cr_expect_eq(gpt_tp_head_forward(cfg, &one, TB, TT, w, w, w, x, NULL, NULL, logits, &s), 0,
                 "logits alone need no targets");
    free(logits);
    tok[0] = 0;
    p.t[GPT_FC_B] = NULL;
    cr_expect_eq(gpt_tp_block_forward(cfg, &one, TB, TT, &p, x, y, &s), -EINVAL);
    cr_expect_eq(gpt_tp_block_params_at(cfg, 1, 0, NULL, &p), -EINVAL);
    cr_expect_eq(gpt_tp_block_grads_at(cfg, 4, 0, blk, &g), -EINVAL);
    int lo, hi;
    cr_expect_eq(gpt_tp_vocab_range(cfg, 4, 0, &lo, &hi), -EINVAL);
    cr_expect_eq(gpt_tp_vocab_range(cfg, 2, 0, NULL, &hi), -EINVAL);
    free(blk);
    free(s.mem);
    free(w);
    free(y);
    free(x);
}

/* A collective's failure is each call's answer, not a crash or a silent result. */
static int failing_allreduce(void *ctx, float *buf, size_t count)
{
    (void)buf;
    (void)count;
    ++*(int *)ctx;
    return -EIO;
}

static int failing_allgather(void *ctx, const float *send, float *recv, size_t count)
{
    (void)send;
    (void)recv;
    (void)count;
    ++*(int *)ctx;
    return -ECONNRESET;
}

Test(gpt_tp, collective_failure_is_returned)
{
    const struct gpt_config *cfg = &cfg61;
    int calls = 0;
    struct gpt_tp_comm c = {.tp = 2,
                            .rank = 1,
                            .allreduce = failing_allreduce,
                            .allgather = failing_allgather,
                            .ctx = &calls};
    struct gpt_scratch s = {.bytes = gpt_tp_scratch_bytes(cfg, 2, TB, TT)};
    s.mem = malloc(s.bytes);
    cr_assert_not_null(s.mem);
    size_t nb = gpt_tp_block_num_params(cfg, 2, 1);
    float *blk = falloc(nb), *gblk = falloc(nb), *x = falloc(TN * MAX_C), *y = falloc(TN * MAX_C);
    float *w = falloc(MAX_V * MAX_C), loss;
    int tok[TN] = {0};
    struct gpt_block_params p;
    struct gpt_block_grads g;
    gpt_tp_block_params_at(cfg, 2, 1, blk, &p);
    gpt_tp_block_grads_at(cfg, 2, 1, gblk, &g);
    cr_expect_eq(gpt_tp_embed_forward(cfg, &c, TB, TT, w, w, tok, x), -EIO);
    cr_expect_eq(gpt_tp_block_forward(cfg, &c, TB, TT, &p, x, y, &s), -EIO);
    cr_expect_eq(gpt_tp_block_backward(cfg, &c, TB, TT, &p, x, y, y, &g, &s), -EIO);
    cr_expect_eq(gpt_tp_head_forward(cfg, &c, TB, TT, w, w, w, x, tok, &loss, NULL, &s),
                 -ECONNRESET);
    cr_expect_eq(gpt_tp_head_backward(cfg, &c, TB, TT, w, w, w, x, tok, y, w, w, w, &loss, &s),
                 -ECONNRESET);
    cr_expect_eq(calls, 5, "each call stopped at its first failed collective: %d calls", calls);
    free(w);
    free(y);
    free(x);
    free(gblk);
    free(blk);
    free(s.mem);
}
