/*
 * gpt_tp_vocab.c - tensor parallelism of gpt_tp.h, part two: the vocab-parallel embedding
 * and LM head with its cross-entropy, each rank holding the rows [lo, hi) of the tied wte.
 *
 * The embedding: each token's row lives on one rank, so each rank writes the rows of its
 * tokens and zeros for the others, and the allreduce's sum (one value and zeros) is exact:
 * the same bits as the one-rank embedding at every tp. The head: each rank computes its
 * columns of the logits; the softmax over the whole vocabulary needs each row's maximum (an
 * allgather of the ranks' maxima, whose max is exact), the sum of exponentials and the
 * target's logit (one allreduce). At tp == 1 the cross-entropy is ops_crossentropy itself,
 * so the bits are gpt.c's; for tp > 1 each rank's sum of exponentials is taken in double,
 * as ops_crossentropy takes it, and goes through the float allreduce.
 *
 * Not here: the checks and the scratch's size (gpt_tp.c), the blocks, the collectives.
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "train/gpt.h"
#include "train/gpt_tp.h"
#include "train/gpt_tp_int.h"
#include "train/ops.h"

#define COL_BLOCK 64 /* columns per thread task in the embedding's sums over rows */

/* The head's internals on one rank. */
struct head_acts {
    float *lnf, *mean, *rstd; /* (B,T,C), (B,T), (B,T) */
    float *logits;            /* (B,T,V_r); dloss/dlogits in place after the backward's loss */
    float *losses;            /* (B,T) */
    float *d_lnf;             /* (B,T,C) */
    float *stats;             /* (2,B,T): the sums of exponentials, then the target logits */
    float *maxes;             /* (B,T): this rank's row maxima, then the whole rows' */
    float *gathered;          /* (tp,B,T): every rank's row maxima */
};

static void carve_head(struct head_acts *h, float *base, size_t *off, size_t N, size_t C, size_t Vr,
                       size_t tp)
{
    h->lnf = gpt_tp_take(base, off, N * C);
    h->mean = gpt_tp_take(base, off, N);
    h->rstd = gpt_tp_take(base, off, N);
    h->logits = gpt_tp_take(base, off, N * Vr);
    h->losses = gpt_tp_take(base, off, N);
    h->d_lnf = gpt_tp_take(base, off, N * C);
    h->stats = gpt_tp_take(base, off, 2 * N);
    h->maxes = gpt_tp_take(base, off, N);
    h->gathered = gpt_tp_take(base, off, tp * N);
}

/* The most rows of wte a rank holds: V r / tp splits give at most ceil(V / tp). */
static size_t vocab_rows_max(const struct gpt_config *cfg, int tp)
{
    return ((size_t)cfg->V + (size_t)tp - 1) / (size_t)tp;
}

size_t gpt_tp_head_scratch_floats(const struct gpt_config *cfg, int tp, int B, int T)
{
    struct head_acts h;
    size_t off = 0;
    carve_head(&h, NULL, &off, (size_t)B * (size_t)T, (size_t)cfg->C, vocab_rows_max(cfg, tp),
               (size_t)tp);
    return off;
}

/* ---- embedding --------------------------------------------------------------------------- */

int gpt_tp_embed_forward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T,
                         const float *wte_r, const float *wpe, const int *tokens, float *x)
{
    int r = gpt_tp_check_call(cfg, comm, B, T);
    if (r < 0) return r;
    if (!wte_r || !wpe || !x) return -EINVAL;
    size_t N = (size_t)B * (size_t)T, C = (size_t)cfg->C, Tz = (size_t)T;
    if ((r = gpt_tp_check_tokens(tokens, N, cfg->V)) < 0) return r;
    int lo = 0, hi = 0;
    gpt_tp_vocab_range(cfg, comm->tp, comm->rank, &lo, &hi);
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        float *o = x + n * C;
        if (tokens[n] < lo || tokens[n] >= hi) {
            memset(o, 0, C * sizeof(float));
            continue;
        }
        const float *te = wte_r + (size_t)(tokens[n] - lo) * C, *pe = wpe + (n % Tz) * C;
        for (size_t c = 0; c < C; c++)
            o[c] = te[c] + pe[c];
    }
    return gpt_tp_allreduce(comm, x, N * C);
}

/* Rows that share a token (or a position) add into the same row of d_wte_r (d_wpe), so the
 * work is split by columns and each column is summed over (b,t) in order, as
 * ops_embed_backward sums it: d_wpe is the same on every rank and d_wte_r's rows are the
 * one-rank d_wte's, bit for bit. */
int gpt_tp_embed_backward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B,
                          int T, const int *tokens, const float *d_x, float *d_wte_r, float *d_wpe)
{
    int r = gpt_tp_check_call(cfg, comm, B, T);
    if (r < 0) return r;
    if (!d_x || !d_wte_r || !d_wpe) return -EINVAL;
    size_t N = (size_t)B * (size_t)T, C = (size_t)cfg->C, Tz = (size_t)T;
    if ((r = gpt_tp_check_tokens(tokens, N, cfg->V)) < 0) return r;
    int lo = 0, hi = 0;
    gpt_tp_vocab_range(cfg, comm->tp, comm->rank, &lo, &hi);
    size_t nblk = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t blk = 0; blk < nblk; blk++) {
        size_t c0 = blk * COL_BLOCK, c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;
        for (size_t n = 0; n < N; n++) {
            const float *g = d_x + n * C;
            float *pe = d_wpe + (n % Tz) * C;
            for (size_t c = c0; c < c1; c++)
                pe[c] += g[c];
            if (tokens[n] < lo || tokens[n] >= hi) continue;
            float *te = d_wte_r + (size_t)(tokens[n] - lo) * C;
            for (size_t c = c0; c < c1; c++)
                te[c] += g[c];
        }
    }
    return 0;
}

/* ---- head -------------------------------------------------------------------------------- */

/* lnf (N,C) of x and this rank's logits (N,Vr). */
static void head_logits(size_t N, size_t C, size_t Vr, const float *lnf_w, const float *lnf_b,
                        const float *wte_r, const float *x, struct head_acts *h)
{
    ops_layernorm_forward(h->lnf, h->mean, h->rstd, x, lnf_w, lnf_b, N, C);
    ops_gemm(0, 1, N, Vr, C, h->lnf, C, wte_r, C, 0.0f, h->logits, Vr);
}

/* *loss = the mean over the N rows of -log softmax(row)[target], the rows spread over the
 * ranks by columns [lo, lo + Vr); with want_grad, h->logits becomes dloss/dlogits in
 * place. At tp == 1, ops_crossentropy. */
static int vp_crossentropy(const struct gpt_tp_comm *c, size_t N, size_t V, size_t lo, size_t Vr,
                           const int *targets, int want_grad, struct head_acts *h, float *loss)
{
    if (c->tp == 1) {
        *loss = ops_crossentropy(h->logits, h->losses, targets, N, V, want_grad);
        return 0;
    }
    float *lg = h->logits, *sums = h->stats, *tl = h->stats + N;
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        const float *l = lg + n * Vr;
        float mx = -INFINITY;
        for (size_t j = 0; j < Vr; j++)
            if (l[j] > mx) mx = l[j];
        h->maxes[n] = mx;
    }
    int r = c->allgather(c->ctx, h->maxes, h->gathered, N);
    if (r < 0) return r;
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        float mx = -INFINITY;
        for (size_t k = 0; k < (size_t)c->tp; k++)
            if (h->gathered[k * N + n] > mx) mx = h->gathered[k * N + n];
        const float *l = lg + n * Vr;
        double sum = 0.0;
        for (size_t j = 0; j < Vr; j++)
            sum += (double)expf(l[j] - mx);
        size_t tgt = (size_t)targets[n];
        h->maxes[n] = mx;
        sums[n] = (float)sum;
        tl[n] = tgt >= lo && tgt < lo + Vr ? l[tgt - lo] - mx : 0.0f;
    }
    if ((r = gpt_tp_allreduce(c, h->stats, 2 * N)) < 0) return r;
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        h->losses[n] = (float)(log((double)sums[n]) - (double)tl[n]);
        if (!want_grad) continue;
        float *l = lg + n * Vr, mx = h->maxes[n];
        float inv = (float)(1.0 / (double)sums[n]), invN = 1.0f / (float)N;
        size_t tgt = (size_t)targets[n];
        for (size_t j = 0; j < Vr; j++) {
            float prob = expf(l[j] - mx) * inv;
            l[j] = (prob - (j + lo == tgt ? 1.0f : 0.0f)) * invN;
        }
    }
    double total = 0.0;
    for (size_t n = 0; n < N; n++)
        total += h->losses[n];
    *loss = (float)(total / (double)N);
    return 0;
}

/* The sizes and scratch of a head call; 0 or -EINVAL. */
static int head_setup(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T,
                      struct gpt_scratch *s, struct head_acts *h, size_t *lo, size_t *Vr)
{
    float *base = gpt_tp_scratch_base(cfg, comm->tp, B, T, s);
    if (!base) return -EINVAL;
    int vlo = 0, vhi = 0;
    gpt_tp_vocab_range(cfg, comm->tp, comm->rank, &vlo, &vhi);
    *lo = (size_t)vlo;
    *Vr = (size_t)(vhi - vlo);
    size_t off = 0;
    carve_head(h, base, &off, (size_t)B * (size_t)T, (size_t)cfg->C, vocab_rows_max(cfg, comm->tp),
               (size_t)comm->tp);
    return 0;
}

int gpt_tp_head_forward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T,
                        const float *lnf_w, const float *lnf_b, const float *wte_r, const float *x,
                        const int *targets, float *loss, float *logits, struct gpt_scratch *s)
{
    int r = gpt_tp_check_call(cfg, comm, B, T);
    if (r < 0) return r;
    if (!lnf_w || !lnf_b || !wte_r || !x) return -EINVAL;
    size_t N = (size_t)B * (size_t)T, C = (size_t)cfg->C, lo, Vr;
    if (loss && (r = gpt_tp_check_tokens(targets, N, cfg->V)) < 0) return r;
    struct head_acts h;
    if ((r = head_setup(cfg, comm, B, T, s, &h, &lo, &Vr)) < 0) return r;
    head_logits(N, C, Vr, lnf_w, lnf_b, wte_r, x, &h);
    if (logits) memcpy(logits, h.logits, N * Vr * sizeof(float));
    if (!loss) return 0;
    return vp_crossentropy(comm, N, (size_t)cfg->V, lo, Vr, targets, 0, &h, loss);
}

/* d_lnf (N,C) = dlogits (N,Vr) @ wte_r (Vr,C) is each rank's share of lnf's input gradient,
 * summed by the allreduce; d_wte_r += dlogits^T @ lnf. lnf's own backward then runs on the
 * same values on every rank. d_x may be x: only the last step reads x, and
 * ops_layernorm_backward allows it. */
int gpt_tp_head_backward(const struct gpt_config *cfg, const struct gpt_tp_comm *comm, int B, int T,
                         const float *lnf_w, const float *lnf_b, const float *wte_r, const float *x,
                         const int *targets, float *d_x, float *d_lnf_w, float *d_lnf_b,
                         float *d_wte_r, float *loss, struct gpt_scratch *s)
{
    int r = gpt_tp_check_call(cfg, comm, B, T);
    if (r < 0) return r;
    if (!lnf_w || !lnf_b || !wte_r || !x || !d_x || !d_lnf_w || !d_lnf_b || !d_wte_r)
        return -EINVAL;
    size_t N = (size_t)B * (size_t)T, C = (size_t)cfg->C, lo, Vr;
    if ((r = gpt_tp_check_tokens(targets, N, cfg->V)) < 0) return r;
    struct head_acts h;
    if ((r = head_setup(cfg, comm, B, T, s, &h, &lo, &Vr)) < 0) return r;
    head_logits(N, C, Vr, lnf_w, lnf_b, wte_r, x, &h);
    float l;
    if ((r = vp_crossentropy(comm, N, (size_t)cfg->V, lo, Vr, targets, 1, &h, &l)) < 0) return r;
    ops_gemm(0, 0, N, C, Vr, h.logits, Vr, wte_r, C, 0.0f, h.d_lnf, C);
    ops_gemm(1, 0, Vr, C, N, h.logits, Vr, h.lnf, C, 1.0f, d_wte_r, C);
    if ((r = gpt_tp_allreduce(comm, h.d_lnf, N * C)) < 0) return r;
    ops_layernorm_backward(d_x, 0, d_lnf_w, d_lnf_b, h.d_lnf, x, lnf_w, h.mean, h.rstd, N, C);
    if (loss) *loss = l;
    return 0;
}
