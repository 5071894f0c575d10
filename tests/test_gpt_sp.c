/*
 * test_gpt_sp.c - src/train/gpt_sp: Ulysses sequence parallelism of the GPT math, proved
 * against the one-rank math of gpt.h.
 *
 * The sp ranks are threads of this process, each with its own OpenMP team and scratch, and
 * the all-to-all is a copy between them over a barrier (what comm_alltoall does between
 * processes). Shapes are small and odd on purpose (C=48, NH=6, B=2, T=12 over sp 2, 3 and
 * 6, T=14 over sp 2): every rank holds several heads or one, several positions or two.
 * Each check compares the ranks' outputs, put back together by position, with gpt.h's on
 * the whole sequence; parameter gradients are summed over the ranks in rank order, as the
 * trainer's allreduce will. Not here: a real communicator (test_comm_a2a checks
 * comm_alltoall), the trainer.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "train/gpt.h"
#include "train/gpt_sp.h"
#include "train/ops.h"

#define MAX_SP 8
#define TOL_REL 1e-5 /* max |sp - one rank| over max |one rank|, for reassociated sums */

static const struct gpt_config cfg48 = {.V = 64, .maxT = 16, .L = 1, .C = 48, .NH = 6};

TestSuite(gpt_sp, .fini = test_leak_check);

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

static float *frand(size_t n, float scale, uint64_t seed)
{
    float *p = falloc(n);
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        p[i] = scale * urand(&s);
    return p;
}

/* A whole model of cfg (L=1) initialised as GPT-2, then every value moved by up to +-0.3 so
 * no gradient vanishes by symmetry. */
static float *model_params(const struct gpt_config *cfg, uint64_t seed)
{
    size_t n = gpt_num_params(cfg);
    float *p = falloc(n);
    cr_assert_eq(gpt_model_init(cfg, p, seed), 0);
    uint64_t s = seed * 7 + 1;
    for (size_t i = 0; i < n; i++)
        p[i] += 0.3f * urand(&s);
    return p;
}

/* The one block of a model buffer from model_params(). */
static const float *block_of(const struct gpt_config *cfg, const float *params)
{
    return params + ((size_t)cfg->V + (size_t)cfg->maxT) * (size_t)cfg->C;
}

/* max |a - b| / max |b| over n values. */
static double rel_err(const float *a, const float *b, size_t n)
{
    double diff = 0.0, mx = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]), m = fabs((double)b[i]);
        if (d > diff) diff = d;
        if (m > mx) mx = m;
    }
    return mx > 0.0 ? diff / mx : diff;
}

/* Rows of positions [r*Tl, (r+1)*Tl) of full (B,T,w) to or from local (B,Tl,w). */
static void slice(float *local, float *full, int B, int T, int sp, int r, size_t w, int to_local)
{
    int Tl = T / sp;
    for (int b = 0; b < B; b++) {
        float *f = full + ((size_t)b * T + (size_t)r * Tl) * w;
        float *l = local + (size_t)b * Tl * w;
        if (to_local)
            memcpy(l, f, (size_t)Tl * w * sizeof(float));
        else
            memcpy(f, l, (size_t)Tl * w * sizeof(float));
    }
}

static void slice_int(int *local, const int *full, int B, int T, int sp, int r)
{
    int Tl = T / sp;
    for (int b = 0; b < B; b++)
        memcpy(local + (size_t)b * Tl, full + (size_t)b * T + (size_t)r * Tl,
               (size_t)Tl * sizeof(int));
}

/* Whether ops_gemm gives every rank's rows the bits of the same rows in the one-rank call,
 * for each GEMM whose rows are positions: the forward's (op(B) transposed, W (n,k)) and the
 * input gradients' (op(B) plain, W (k,n)), at the (n,k) of a block and of the head. Each
 * output element is one sum over the same k values either way, but the kernel that makes
 * it may depend on where the row falls in the call: OpenBLAS's Haswell and SkylakeX kernels
 * (OPENBLAS_CORETYPE=...) give some rows other bits in a call of B*T/sp rows, its Prescott
 * and Sandybridge ones do not. So this asks the kernels at hand, and the checks below assert
 * bits only where the GEMMs give them, the tolerance everywhere. */
static bool gemm_rows_stable(int B, int T, int sp, size_t C, size_t V)
{
    const size_t nk[][2] = {{3 * C, C}, {C, C}, {4 * C, C}, {C, 4 * C}, {C, 3 * C}, {V, C}, {C, V}};
    size_t M = (size_t)B * T, Tl = (size_t)T / sp, m = (size_t)B * Tl;
    bool stable = true;
    for (size_t i = 0; i < sizeof(nk) / sizeof(nk[0]) && stable; i++) {
        size_t n = nk[i][0], k = nk[i][1];
        float *A = frand(M * k, 1.0f, 31 + i), *W = frand(n * k, 1.0f, 41 + i);
        float *full = falloc(M * n), *al = falloc(m * k), *part = falloc(m * n),
              *want = falloc(m * n);
        for (int tb = 0; tb <= 1 && stable; tb++) {
            ops_gemm(0, tb, M, n, k, A, k, W, tb ? k : n, 0.0f, full, n);
            for (int r = 0; r < sp && stable; r++) {
                slice(al, A, B, T, sp, r, k, 1);
                slice(want, full, B, T, sp, r, n, 1);
                ops_gemm(0, tb, m, n, k, al, k, W, tb ? k : n, 0.0f, part, n);
                stable = memcmp(part, want, m * n * sizeof(float)) == 0;
            }
        }
        free(want);
        free(part);
        free(al);
        free(full);
        free(W);
        free(A);
    }
    if (!stable)
        cr_log_info("B=%d T=%d sp=%d: this CPU's GEMM kernels give a row different bits in a "
                    "call of B*T/sp rows: checked within tolerance only",
                    B, T, sp);
    return stable;
}

/* ---- the ranks: threads and an in-memory all-to-all --------------------------------------- */

/* One sp-rank run of a block's forward and backward on the whole (B,T) problem. */
struct sp_job {
    const struct gpt_config *cfg;
    int sp, B, T, threads;
    const float *block;     /* the block's parameters, gpt_block_num_params() floats */
    const float *x, *d_out; /* (B,T,C) each */
    float *y, *d_in;        /* (B,T,C) each, written by position */
    float *grads;           /* sp x gpt_block_num_params(): each rank's partial gradients */
    int rc[MAX_SP];         /* each rank's first nonzero answer */
    int calls[MAX_SP];      /* alltoall calls per rank */
    pthread_barrier_t bar;
    const float *send[MAX_SP];
};

struct sp_rank {
    struct sp_job *job;
    int rank;
};

/* comm_alltoall's contract between threads: every rank posts its send buffer, then copies
 * block r of every rank's buffer; the second barrier keeps the buffers alive until all
 * have copied. */
static int mem_alltoall(void *ctx, const float *send, float *recv, size_t count)
{
    struct sp_rank *me = ctx;
    struct sp_job *j = me->job;
    j->send[me->rank] = send;
    j->calls[me->rank]++;
    pthread_barrier_wait(&j->bar);
    for (int k = 0; k < j->sp; k++)
        memcpy(recv + (size_t)k * count, j->send[k] + (size_t)me->rank * count,
               count * sizeof(float));
    pthread_barrier_wait(&j->bar);
    return 0;
}

static void *rank_main(void *arg)
{
    struct sp_rank *me = arg;
    struct sp_job *j = me->job;
    const struct gpt_config *cfg = j->cfg;
    int r = me->rank, Tl = j->T / j->sp;
    size_t C = (size_t)cfg->C, NC = (size_t)j->B * Tl * C, nb = gpt_block_num_params(cfg);
    omp_set_num_threads(j->threads); /* this thread's own OpenMP team */
    struct gpt_scratch s = {.bytes = gpt_sp_scratch_bytes(cfg, j->sp, j->B, j->T)};
    s.mem = malloc(s.bytes);
    float *x = malloc(NC * sizeof(float)), *y = malloc(NC * sizeof(float));
    float *dout = malloc(NC * sizeof(float)), *din = malloc(NC * sizeof(float));
    if (!s.bytes || !s.mem || !x || !y || !dout || !din) {
        j->rc[r] = -ENOMEM; /* the others then wait at the barrier: the test times out */
        goto out;
    }
    struct gpt_block_params p;
    struct gpt_block_grads g;
    gpt_block_params_at(cfg, j->block, &p);
    gpt_block_grads_at(cfg, j->grads + (size_t)r * nb, &g);
    slice(x, (float *)j->x, j->B, j->T, j->sp, r, C, 1);
    slice(dout, (float *)j->d_out, j->B, j->T, j->sp, r, C, 1);
    int rc = gpt_sp_block_forward(cfg, j->sp, r, j->B, j->T, &p, x, y, &s, mem_alltoall, me);
    if (rc == 0)
        rc = gpt_sp_block_backward(cfg, j->sp, r, j->B, j->T, &p, x, dout, din, &g, &s,
                                   mem_alltoall, me);
    j->rc[r] = rc;
    if (rc == 0) {
        slice(y, j->y, j->B, j->T, j->sp, r, C, 0);
        slice(din, j->d_in, j->B, j->T, j->sp, r, C, 0);
    }
out:
    free(din);
    free(dout);
    free(y);
    free(x);
    free(s.mem);
    return NULL;
}

/* Runs the job's sp ranks to the end; asserts every one succeeded. */
static void run_ranks(struct sp_job *j)
{
    cr_assert(j->sp >= 1 && j->sp <= MAX_SP);
    pthread_t th[MAX_SP];
    struct sp_rank ranks[MAX_SP];
    cr_assert_eq(pthread_barrier_init(&j->bar, NULL, (unsigned)j->sp), 0);
    memset(j->rc, 0, sizeof(j->rc));
    memset(j->calls, 0, sizeof(j->calls));
    for (int r = 0; r < j->sp; r++) {
        ranks[r] = (struct sp_rank){.job = j, .rank = r};
        cr_assert_eq(pthread_create(&th[r], NULL, rank_main, &ranks[r]), 0);
    }
    for (int r = 0; r < j->sp; r++)
        pthread_join(th[r], NULL);
    pthread_barrier_destroy(&j->bar);
    for (int r = 0; r < j->sp; r++) {
        cr_assert_eq(j->rc[r], 0, "rank %d of %d answered %d", r, j->sp, j->rc[r]);
        /* two exchanges in the forward, two in the recompute, two in the backward */
        cr_assert_eq(j->calls[r], 6, "rank %d made %d exchanges", r, j->calls[r]);
    }
}

/* A problem and the one-rank answer to compare with. */
struct problem {
    const struct gpt_config *cfg;
    int B, T;
    float *params, *x, *d_out;
    float *y_ref, *d_in_ref, *g_ref; /* gpt.h's answers; g_ref gpt_block_num_params() */
};

static void problem_make(struct problem *pb, const struct gpt_config *cfg, int B, int T,
                         uint64_t seed)
{
    size_t NC = (size_t)B * T * (size_t)cfg->C, nb = gpt_block_num_params(cfg);
    *pb = (struct problem){.cfg = cfg, .B = B, .T = T};
    pb->params = model_params(cfg, seed);
    pb->x = frand(NC, 1.0f, seed + 1);
    pb->d_out = frand(NC, 0.1f, seed + 2);
    pb->y_ref = falloc(NC);
    pb->d_in_ref = falloc(NC);
    pb->g_ref = falloc(nb);
    struct gpt_scratch s = {.bytes = gpt_scratch_bytes(cfg, B, T)};
    s.mem = malloc(s.bytes);
    cr_assert_not_null(s.mem);
    struct gpt_block_params p;
    struct gpt_block_grads g;
    gpt_block_params_at(cfg, block_of(cfg, pb->params), &p);
    gpt_block_grads_at(cfg, pb->g_ref, &g);
    cr_assert_eq(gpt_block_forward(cfg, B, T, &p, pb->x, pb->y_ref, &s), 0);
    cr_assert_eq(gpt_block_backward(cfg, B, T, &p, pb->x, pb->d_out, pb->d_in_ref, &g, &s), 0);
    free(s.mem);
}

static void problem_free(struct problem *pb)
{
    free(pb->params);
    free(pb->x);
    free(pb->d_out);
    free(pb->y_ref);
    free(pb->d_in_ref);
    free(pb->g_ref);
}

/* The job for pb over sp ranks at threads OpenMP threads each, with its output buffers. */
static void job_make(struct sp_job *j, const struct problem *pb, int sp, int threads)
{
    size_t NC = (size_t)pb->B * pb->T * (size_t)pb->cfg->C, nb = gpt_block_num_params(pb->cfg);
    *j = (struct sp_job){.cfg = pb->cfg, .sp = sp, .B = pb->B, .T = pb->T, .threads = threads};
    j->block = block_of(pb->cfg, pb->params);
    j->x = pb->x;
    j->d_out = pb->d_out;
    j->y = falloc(NC);
    j->d_in = falloc(NC);
    j->grads = falloc((size_t)sp * nb);
}

static void job_free(struct sp_job *j)
{
    free(j->y);
    free(j->d_in);
    free(j->grads);
}

/* The ranks' partial gradients summed in rank order, as an allreduce in rank order does. */
static float *sum_grads(const struct sp_job *j)
{
    size_t nb = gpt_block_num_params(j->cfg);
    float *sum = falloc(nb);
    for (int r = 0; r < j->sp; r++)
        for (size_t i = 0; i < nb; i++)
            sum[i] += j->grads[(size_t)r * nb + i];
    return sum;
}

/* ---- the block ---------------------------------------------------------------------------- */

/* Every output of sp ranks against one rank's, within TOL_REL, and bitwise where that
 * holds. The forward and the input gradient are bitwise when the GEMMs give each row the
 * same bits in a call of B*T/sp rows (gemm_rows_stable): every position's arithmetic is
 * then the one-rank arithmetic, the other position-wise layers being per-row loops, and a
 * head's attention reading only that head's q, k and v over the whole sequence, which the
 * exchanges move without touching. Parameter gradients are sums over positions, cut into
 * one sum per rank and then added across ranks: equal only up to reassociation. */
static void check_block(int B, int T, int sp)
{
    struct problem pb;
    problem_make(&pb, &cfg48, B, T, 1000 + (uint64_t)(T * 16 + sp));
    struct sp_job j;
    job_make(&j, &pb, sp, 2);
    run_ranks(&j);
    size_t NC = (size_t)B * T * (size_t)cfg48.C, nb = gpt_block_num_params(&cfg48);
    double ey = rel_err(j.y, pb.y_ref, NC), ed = rel_err(j.d_in, pb.d_in_ref, NC);
    cr_expect_leq(ey, TOL_REL, "T=%d sp=%d: forward off by %g", T, sp, ey);
    cr_expect_leq(ed, TOL_REL, "T=%d sp=%d: d_in off by %g", T, sp, ed);
    if (gemm_rows_stable(B, T, sp, (size_t)cfg48.C, (size_t)cfg48.V)) {
        cr_expect_eq(memcmp(j.y, pb.y_ref, NC * sizeof(float)), 0,
                     "T=%d sp=%d: the forward is not bitwise one rank's (off by %g)", T, sp, ey);
        cr_expect_eq(memcmp(j.d_in, pb.d_in_ref, NC * sizeof(float)), 0,
                     "T=%d sp=%d: d_in is not bitwise one rank's (off by %g)", T, sp, ed);
    }
    float *g = sum_grads(&j);
    struct gpt_block_grads gs, gr;
    gpt_block_grads_at(&cfg48, g, &gs);
    gpt_block_grads_at(&cfg48, pb.g_ref, &gr);
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++) {
        const float *end = s + 1 < GPT_BLOCK_NSLOTS ? gr.t[s + 1] : pb.g_ref + nb;
        size_t n = (size_t)(end - gr.t[s]);
        double e = rel_err(gs.t[s], gr.t[s], n);
        cr_expect_leq(e, TOL_REL, "T=%d sp=%d: gradient of %s off by %g", T, sp,
                      gpt_block_slot_name(s), e);
    }
    free(g);
    job_free(&j);
    problem_free(&pb);
}

Test(gpt_sp, block_T12_sp2)
{
    check_block(2, 12, 2);
}

Test(gpt_sp, block_T12_sp3)
{
    check_block(2, 12, 3);
}

Test(gpt_sp, block_T12_sp6)
{
    check_block(2, 12, 6);
}

Test(gpt_sp, block_T14_sp2)
{
    check_block(2, 14, 2);
}

/* sp == 1 is gpt.h's block, bits and all: with the callback and without one. */
Test(gpt_sp, block_sp1_is_gpt_bitwise)
{
    struct problem pb;
    problem_make(&pb, &cfg48, 2, 12, 77);
    size_t NC = (size_t)2 * 12 * cfg48.C, nb = gpt_block_num_params(&cfg48);
    struct sp_job j;
    job_make(&j, &pb, 1, 2);
    run_ranks(&j);
    cr_assert_eq(memcmp(j.y, pb.y_ref, NC * sizeof(float)), 0);
    cr_assert_eq(memcmp(j.d_in, pb.d_in_ref, NC * sizeof(float)), 0);
    cr_assert_eq(memcmp(j.grads, pb.g_ref, nb * sizeof(float)), 0);
    job_free(&j);

    /* No callback: the one exchange is a local copy. */
    struct gpt_scratch s = {.bytes = gpt_sp_scratch_bytes(&cfg48, 1, 2, 12)};
    s.mem = malloc(s.bytes);
    float *y = falloc(NC), *din = falloc(NC), *g = falloc(nb);
    struct gpt_block_params p;
    struct gpt_block_grads gg;
    gpt_block_params_at(&cfg48, block_of(&cfg48, pb.params), &p);
    gpt_block_grads_at(&cfg48, g, &gg);
    cr_assert_eq(gpt_sp_block_forward(&cfg48, 1, 0, 2, 12, &p, pb.x, y, &s, NULL, NULL), 0);
    cr_assert_eq(
        gpt_sp_block_backward(&cfg48, 1, 0, 2, 12, &p, pb.x, pb.d_out, din, &gg, &s, NULL, NULL),
        0);
    cr_assert_eq(memcmp(y, pb.y_ref, NC * sizeof(float)), 0);
    cr_assert_eq(memcmp(din, pb.d_in_ref, NC * sizeof(float)), 0);
    cr_assert_eq(memcmp(g, pb.g_ref, nb * sizeof(float)), 0);
    free(g);
    free(din);
    free(y);
    free(s.mem);
    problem_free(&pb);
}

/* The same bits run to run, and with 1 or 2 OpenMP threads per rank. */
Test(gpt_sp, block_same_bits_any_threads)
{
    struct problem pb;
    problem_make(&pb, &cfg48, 2, 12, 5);
    size_t NC = (size_t)2 * 12 * cfg48.C, nb = gpt_block_num_params(&cfg48);
    struct sp_job a, b, c;
    job_make(&a, &pb, 3, 1);
    job_make(&b, &pb, 3, 1);
    job_make(&c, &pb, 3, 2);
    run_ranks(&a);
    run_ranks(&b);
    run_ranks(&c);
    const struct sp_job *other[] = {&b, &c};
    for (int k = 0; k < 2; k++) {
        const struct sp_job *o = other[k];
        cr_assert_eq(memcmp(a.y, o->y, NC * sizeof(float)), 0, "forward differs (%d)", k);
        cr_assert_eq(memcmp(a.d_in, o->d_in, NC * sizeof(float)), 0, "d_in differs (%d)", k);
        cr_assert_eq(memcmp(a.grads, o->grads, 3 * nb * sizeof(float)), 0,
                     "a rank's gradients differ (%d)", k);
    }
    job_free(&c);
    job_free(&b);
    job_free(&a);
    problem_free(&pb);
}

/* Attention heads of a size that is no multiple of 8 take ops.c's scalar attention, not
 * the vector one: the exchanges are the same. C=30, NH=6: heads of 5. */
Test(gpt_sp, block_odd_head_size)
{
    static const struct gpt_config cfg30 = {.V = 64, .maxT = 16, .L = 1, .C = 30, .NH = 6};
    struct problem pb;
    problem_make(&pb, &cfg30, 2, 12, 9);
    struct sp_job j;
    job_make(&j, &pb, 3, 2);
    run_ranks(&j);
    size_t NC = (size_t)2 * 12 * cfg30.C, nb = gpt_block_num_params(&cfg30);
    double ey = rel_err(j.y, pb.y_ref, NC), ed = rel_err(j.d_in, pb.d_in_ref, NC);
    cr_expect_leq(ey, TOL_REL, "forward off by %g", ey);
    cr_expect_leq(ed, TOL_REL, "d_in off by %g", ed);
    if (gemm_rows_stable(2, 12, 3, (size_t)cfg30.C, (size_t)cfg30.V)) {
        cr_expect_eq(memcmp(j.y, pb.y_ref, NC * sizeof(float)), 0);
        cr_expect_eq(memcmp(j.d_in, pb.d_in_ref, NC * sizeof(float)), 0);
    }
    float *g = sum_grads(&j);
    double e = rel_err(g, pb.g_ref, nb);
    cr_expect_leq(e, TOL_REL, "gradients off by %g", e);
    free(g);
    job_free(&j);
    problem_free(&pb);
}

/* ---- embedding and head ------------------------------------------------------------------ */

/* The embedding of each rank's positions is the one-rank embedding's rows, bitwise (each
 * element is one add). d_wpe's rows belong to one rank each, so their sum over ranks is
 * bitwise too; d_wte sums a token's rows over the ranks' positions: reassociated. */
static void check_embed(int B, int T, int sp)
{
    const struct gpt_config *cfg = &cfg48;
    size_t C = (size_t)cfg->C, NC = (size_t)B * T * C, Nl = (size_t)B * (T / sp);
    size_t nte = (size_t)cfg->V * C, npe = (size_t)cfg->maxT * C;
    float *wte = frand(nte, 1.0f, 11), *wpe = frand(npe, 1.0f, 12), *d_x = frand(NC, 1.0f, 13);
    int *tok = malloc((size_t)B * T * sizeof(int)), *tl = malloc(Nl * sizeof(int));
    cr_assert(tok && tl);
    uint64_t s = 14;
    for (int i = 0; i < B * T; i++)
        tok[i] = (int)(test_rand(&s) % 8); /* few tokens: rows of d_wte shared by positions */
    float *x_ref = falloc(NC), *x = falloc(NC), *xl = falloc(Nl * C), *dl = falloc(Nl * C);
    float *dte_ref = falloc(nte), *dpe_ref = falloc(npe), *dte = falloc(nte), *dpe = falloc(npe);
    float *dte_r = falloc(nte), *dpe_r = falloc(npe);
    cr_assert_eq(gpt_embed_forward(cfg, B, T, wte, wpe, tok, x_ref), 0);
    cr_assert_eq(gpt_embed_backward(cfg, B, T, tok, d_x, dte_ref, dpe_ref), 0);
    for (int r = 0; r < sp; r++) {
        slice_int(tl, tok, B, T, sp, r);
        cr_assert_eq(gpt_sp_embed_forward(cfg, sp, r, B, T, wte, wpe, tl, xl), 0);
        slice(xl, x, B, T, sp, r, C, 0);
        slice(dl, d_x, B, T, sp, r, C, 1);
        memset(dte_r, 0, nte * sizeof(float));
        memset(dpe_r, 0, npe * sizeof(float));
        cr_assert_eq(gpt_sp_embed_backward(cfg, sp, r, B, T, tl, dl, dte_r, dpe_r), 0);
        for (size_t i = 0; i < nte; i++)
            dte[i] += dte_r[i];
        for (size_t i = 0; i < npe; i++)
            dpe[i] += dpe_r[i];
    }
    cr_expect_eq(memcmp(x, x_ref, NC * sizeof(float)), 0, "sp=%d: embedding differs", sp);
    cr_expect_eq(memcmp(dpe, dpe_ref, npe * sizeof(float)), 0, "sp=%d: d_wpe differs", sp);
    double e = rel_err(dte, dte_ref, nte);
    cr_expect_leq(e, TOL_REL, "sp=%d: d_wte off by %g", sp, e);
    if (sp == 1) cr_expect_eq(memcmp(dte, dte_ref, nte * sizeof(float)), 0);
    free(dpe_r);
    free(dte_r);
    free(dpe);
    free(dte);
    free(dpe_ref);
    free(dte_ref);
    free(dl);
    free(xl);
    free(x);
    free(x_ref);
    free(tl);
    free(tok);
    free(d_x);
    free(wpe);
    free(wte);
}

Test(gpt_sp, embed_against_one_rank)
{
    check_embed(2, 12, 1);
    check_embed(2, 12, 2);
    check_embed(2, 12, 3);
    check_embed(2, 12, 6);
    check_embed(2, 14, 2);
}

/* The head's loss summed over the ranks (in rank order) is the one-rank mean, within 1e-6
 * relative; d_x of each rank's rows matches the one-rank d_x and the parameter gradients'
 * sum over ranks the one-rank gradients, within TOL_REL. sp == 1 is bitwise. */
static void check_head(int B, int T, int sp)
{
    const struct gpt_config *cfg = &cfg48;
    size_t C = (size_t)cfg->C, V = (size_t)cfg->V, NC = (size_t)B * T * C;
    size_t Nl = (size_t)B * (T / sp), nte = V * C;
    float *x = frand(NC, 1.0f, 21), *lw = frand(C, 0.3f, 22), *lb = frand(C, 0.3f, 23);
    float *wte = frand(nte, 0.5f, 24);
    for (size_t i = 0; i < C; i++)
        lw[i] += 1.0f;
    int *tgt = malloc((size_t)B * T * sizeof(int)), *tl = malloc(Nl * sizeof(int));
    cr_assert(tgt && tl);
    uint64_t s = 25;
    for (int i = 0; i < B * T; i++)
        tgt[i] = (int)(test_rand(&s) % V);
    struct gpt_scratch sr = {.bytes = gpt_scratch_bytes(cfg, B, T)};
    struct gpt_scratch ss = {.bytes = gpt_sp_scratch_bytes(cfg, sp, B, T)};
    sr.mem = malloc(sr.bytes);
    ss.mem = malloc(ss.bytes);
    cr_assert(sr.mem && ss.mem);
    float *dx_ref = falloc(NC), *dw_ref = falloc(C), *db_ref = falloc(C), *dte_ref = falloc(nte);
    float *dx = falloc(NC), *dw = falloc(C), *db = falloc(C), *dte = falloc(nte);
    float *dxl = falloc(Nl * C), *xl = falloc(Nl * C), *gw = falloc(C), *gb = falloc(C);
    float *gte = falloc(nte), *lg_ref = falloc((size_t)B * T * V), *lg = falloc(Nl * V);
    float *lgr = falloc(Nl * V);
    bool stable = gemm_rows_stable(B, T, sp, C, V);
    float loss_ref, loss_bw_ref, loss = 0.0f, loss_bw = 0.0f;
    cr_assert_eq(gpt_head_forward(cfg, B, T, lw, lb, wte, x, tgt, &loss_ref, lg_ref, &sr), 0);
    cr_assert_eq(gpt_head_backward(cfg, B, T, lw, lb, wte, x, tgt, dx_ref, dw_ref, db_ref, dte_ref,
                                   &loss_bw_ref, &sr),
                 0);
    for (int r = 0; r < sp; r++) {
        float part, part_bw;
        slice(xl, x, B, T, sp, r, C, 1);
        slice_int(tl, tgt, B, T, sp, r);
        cr_assert_eq(gpt_sp_head_forward(cfg, sp, r, B, T, lw, lb, wte, xl, tl, &part, lg, &ss), 0);
        /* The logits are per position: the one-rank rows, bitwise where the GEMM gives them. */
        slice(lgr, lg_ref, B, T, sp, r, V, 1);
        double el = rel_err(lg, lgr, Nl * V);
        cr_expect_leq(el, TOL_REL, "sp=%d rank %d: logits off by %g", sp, r, el);
        if (stable)
            cr_expect_eq(memcmp(lg, lgr, Nl * V * sizeof(float)), 0, "sp=%d rank %d: logits differ",
                         sp, r);
        memset(gw, 0, C * sizeof(float));
        memset(gb, 0, C * sizeof(float));
        memset(gte, 0, nte * sizeof(float));
        cr_assert_eq(gpt_sp_head_backward(cfg, sp, r, B, T, lw, lb, wte, xl, tl, dxl, gw, gb, gte,
                                          &part_bw, &ss),
                     0);
        cr_expect_eq(part, part_bw, "the forward and the backward disagree on the loss");
        slice(dxl, dx, B, T, sp, r, C, 0);
        loss += part;
        loss_bw += part_bw;
        for (size_t i = 0; i < C; i++) {
            dw[i] += gw[i];
            db[i] += gb[i];
        }
        for (size_t i = 0; i < nte; i++)
            dte[i] += gte[i];
    }
    cr_expect_leq(fabs((double)loss - loss_ref), 1e-6 * fabs((double)loss_ref),
                  "sp=%d: loss %.9g, one rank %.9g", sp, loss, loss_ref);
    cr_expect_eq(loss_bw_ref, loss_ref);
    double ex = rel_err(dx, dx_ref, NC), ew = rel_err(dw, dw_ref, C), eb = rel_err(db, db_ref, C);
    double et = rel_err(dte, dte_ref, nte);
    cr_expect_leq(ex, TOL_REL, "sp=%d: d_x off by %g", sp, ex);
    cr_expect_leq(ew, TOL_REL, "sp=%d: d_lnf_w off by %g", sp, ew);
    cr_expect_leq(eb, TOL_REL, "sp=%d: d_lnf_b off by %g", sp, eb);
    cr_expect_leq(et, TOL_REL, "sp=%d: d_wte off by %g", sp, et);
    /* With sp a power of two the gradient's 1/(B*T) is the rank's 1/(B*T/sp) scaled exactly,
     * so every row's arithmetic is one rank's: d_x is bitwise where the GEMMs allow. */
    if ((sp & (sp - 1)) == 0 && stable)
        cr_expect_eq(memcmp(dx, dx_ref, NC * sizeof(float)), 0, "sp=%d: d_x not bitwise", sp);
    if (sp == 1) {
        cr_expect_eq(memcmp(&loss, &loss_ref, sizeof(float)), 0);
        cr_expect_eq(memcmp(dx, dx_ref, NC * sizeof(float)), 0);
        cr_expect_eq(memcmp(dw, dw_ref, C * sizeof(float)), 0);
        cr_expect_eq(memcmp(db, db_ref, C * sizeof(float)), 0);
        cr_expect_eq(memcmp(dte, dte_ref, nte * sizeof(float)), 0);
    }
    free(lgr);
    free(lg);
    free(lg_ref);
    free(gte);
    free(gb);
    free(gw);
    free(xl);
    free(dxl);
    free(dte);
    free(db);
    free(dw);
    free(dx);
    free(dte_ref);
    free(db_ref);
    free(dw_ref);
    free(dx_ref);
    free(ss.mem);
    free(sr.mem);
    free(tl);
    free(tgt);
    free(wte);
    free(lb);
    free(lw);
    free(x);
}

Test(gpt_sp, head_against_one_rank)
{
    check_head(2, 12, 1);
    check_head(2, 12, 2);
    check_head(2, 12, 3);
    check_head(2, 12, 6);
    check_head(2, 14, 2);
}

/* ---- bad arguments ------------------------------------------------------------------------ */

/* rc is -EINVAL and the log says every one of the words. */
static void expect_refused(int rc, const char *what, const char *w1, const char *w2)
{
    cr_expect_eq(rc, -EINVAL, "%s: answered %d", what, rc);
    const char *log = test_log_text();
    cr_expect(strstr(log, w1) != NULL, "%s: the log does not say '%s': %s", what, w1, log);
    if (w2) cr_expect(strstr(log, w2) != NULL, "%s: the log does not say '%s': %s", what, w2, log);
    test_log_capture_start(); /* clears the text for the next one */
}

Test(gpt_sp, check_names_the_problem)
{
    char msg[160];
    cr_assert_eq(gpt_sp_check(&cfg48, 2, 1, 2, 12, msg, sizeof(msg)), 0);
    cr_assert_eq(gpt_sp_check(&cfg48, 3, 0, 2, 14, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "T=14") && strstr(msg, "sp=3"), "%s", msg);
    cr_assert_eq(gpt_sp_check(&cfg48, 4, 0, 2, 12, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "NH=6") && strstr(msg, "sp=4"), "%s", msg);
    cr_assert_eq(gpt_sp_check(&cfg48, 0, 0, 2, 12, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "sp=0"), "%s", msg);
    cr_assert_eq(gpt_sp_check(&cfg48, 2, 2, 2, 12, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "rank=2") && strstr(msg, "sp=2"), "%s", msg);
    cr_assert_eq(gpt_sp_check(&cfg48, 2, -1, 2, 12, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "rank=-1"), "%s", msg);
    cr_assert_eq(gpt_sp_check(&cfg48, 2, 0, 2, 18, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "T=18") && strstr(msg, "maxT=16"), "%s", msg);
    cr_assert_eq(gpt_sp_check(&cfg48, 2, 0, 0, 12, msg, sizeof(msg)), -EINVAL);
    cr_expect(strstr(msg, "B=0"), "%s", msg);
    cr_assert_eq(gpt_sp_check(NULL, 2, 0, 2, 12, msg, sizeof(msg)), -EINVAL);
    cr_assert_eq(gpt_sp_check(&cfg48, 4, 0, 2, 12, NULL, 0), -EINVAL);
    cr_expect_eq(gpt_sp_scratch_bytes(&cfg48, 5, 2, 12), 0);
    cr_expect_eq(gpt_sp_scratch_bytes(&cfg48, 4, 2, 12), 0);
    cr_expect_gt(gpt_sp_scratch_bytes(&cfg48, 6, 2, 12), 0);
}

Test(gpt_sp, block_refuses_bad_arguments)
{
    struct problem pb;
    problem_make(&pb, &cfg48, 2, 12, 3);
    size_t nb = gpt_block_num_params(&cfg48);
    float *y = falloc(pb.B * pb.T * (size_t)cfg48.C), *gbuf = falloc(nb);
    struct gpt_block_params p, pnull;
    struct gpt_block_grads g;
    gpt_block_params_at(&cfg48, block_of(&cfg48, pb.params), &p);
    gpt_block_grads_at(&cfg48, gbuf, &g);
    pnull = p;
    pnull.t[GPT_FC_W] = NULL;
    struct gpt_scratch s = {.bytes = gpt_sp_scratch_bytes(&cfg48, 2, 2, 12)};
    s.mem = malloc(s.bytes);
    struct gpt_scratch small = {.mem = s.mem, .bytes = s.bytes - 1};
    struct sp_rank me = {0};
    test_log_capture_start();
    expect_refused(gpt_sp_block_forward(&cfg48, 3, 0, 2, 14, &p, pb.x, y, &s, mem_alltoall, &me),
                   "T % sp", "T=14", "sp=3");
    expect_refused(gpt_sp_block_forward(&cfg48, 4, 0, 2, 12, &p, pb.x, y, &s, mem_alltoall, &me),
                   "NH % sp", "NH=6", "sp=4");
    expect_refused(gpt_sp_block_backward(&cfg48, 4, 0, 2, 12, &p, pb.x, pb.d_out, y, &g, &s,
                                         mem_alltoall, &me),
                   "NH % sp (backward)", "NH=6", "sp=4");
    expect_refused(gpt_sp_block_forward(&cfg48, 2, 0, 2, 12, &p, NULL, y, &s, mem_alltoall, &me),
                   "x_in", "x_in is NULL", NULL);
    expect_refused(gpt_sp_block_forward(&cfg48, 2, 0, 2, 12, &p, pb.x, NULL, &s, mem_alltoall, &me),
                   "x_out", "x_out is NULL", NULL);
    expect_refused(gpt_sp_block_forward(&cfg48, 2, 0, 2, 12, NULL, pb.x, y, &s, mem_alltoall, &me),
                   "params", "parameters are NULL", NULL);
    expect_refused(
        gpt_sp_block_forward(&cfg48, 2, 0, 2, 12, &pnull, pb.x, y, &s, mem_alltoall, &me),
        "a NULL slot", "mlp.fc.w is NULL", NULL);
    expect_refused(gpt_sp_block_forward(&cfg48, 2, 0, 2, 12, &p, pb.x, y, &s, NULL, NULL),
                   "no callback", "alltoall callback is NULL", "sp=2");
    expect_refused(gpt_sp_block_forward(&cfg48, 2, 0, 2, 12, &p, pb.x, y, NULL, mem_alltoall, &me),
                   "no scratch", "scratch is NULL", NULL);
    expect_refused(
        gpt_sp_block_forward(&cfg48, 2, 0, 2, 12, &p, pb.x, y, &small, mem_alltoall, &me),
        "small scratch", "gpt_sp_scratch_bytes", NULL);
    expect_refused(gpt_sp_block_backward(&cfg48, 2, 0, 2, 12, &p, pb.x, pb.d_out, y, NULL, &s,
                                         mem_alltoall, &me),
                   "grads", "gradients are NULL", NULL);
    expect_refused(
        gpt_sp_block_backward(&cfg48, 2, 0, 2, 12, &p, pb.x, NULL, y, &g, &s, mem_alltoall, &me),
        "d_out", "d_out is NULL", NULL);
    expect_refused(gpt_sp_block_backward(&cfg48, 2, 0, 2, 12, &p, pb.x, pb.d_out, pb.x, &g, &s,
                                         mem_alltoall, &me),
                   "d_in == x_in", "d_in is x_in", NULL);
    test_log_capture_stop();
    free(s.mem);
    free(gbuf);
    free(y);
    problem_free(&pb);
}

Test(gpt_sp, embed_and_head_refuse_bad_arguments)
{
    const struct gpt_config *cfg = &cfg48;
    size_t C = (size_t)cfg->C;
    float *wte = falloc((size_t)cfg->V * C), *wpe = falloc((size_t)cfg->maxT * C);
    float *x = falloc(12 * C), *lw = falloc(C), *lb = falloc(C), *d = falloc(12 * C);
    int tok[12] = {0};
    struct gpt_scratch s = {.bytes = gpt_sp_scratch_bytes(cfg, 2, 2, 12)};
    s.mem = malloc(s.bytes);
    float loss;
    test_log_capture_start();
    expect_refused(gpt_sp_embed_forward(cfg, 3, 0, 2, 14, wte, wpe, tok, x), "embed T % sp", "T=14",
                   "sp=3");
    expect_refused(gpt_sp_embed_forward(cfg, 2, 0, 2, 12, wte, NULL, tok, x), "embed wpe",
                   "wpe is NULL", NULL);
    expect_refused(gpt_sp_embed_forward(cfg, 2, 0, 2, 12, wte, wpe, NULL, x), "embed tokens",
                   "tokens is NULL", NULL);
    tok[5] = cfg->V;
    expect_refused(gpt_sp_embed_forward(cfg, 2, 0, 2, 12, wte, wpe, tok, x), "embed token",
                   "tokens[5]=64", "V=64");
    expect_refused(gpt_sp_embed_backward(cfg, 2, 1, 2, 12, tok, d, wte, wpe), "embed bw token",
                   "tokens[5]=64", NULL);
    tok[5] = 0;
    expect_refused(gpt_sp_embed_backward(cfg, 4, 0, 2, 12, tok, d, wte, wpe), "embed bw NH", "NH=6",
                   "sp=4");
    expect_refused(gpt_sp_embed_backward(cfg, 2, 0, 2, 12, tok, d, wte, NULL), "embed bw d_wpe",
                   "d_wpe is NULL", NULL);
    expect_refused(gpt_sp_head_forward(cfg, 3, 0, 2, 14, lw, lb, wte, x, tok, &loss, NULL, &s),
                   "head T % sp", "T=14", "sp=3");
    expect_refused(gpt_sp_head_forward(cfg, 2, 0, 2, 12, lw, lb, wte, x, NULL, &loss, NULL, &s),
                   "head targets", "targets is NULL", NULL);
    expect_refused(gpt_sp_head_forward(cfg, 2, 0, 2, 12, NULL, lb, wte, x, tok, &loss, NULL, &s),
                   "head lnf_w", "lnf_w is NULL", NULL);
    expect_refused(
        gpt_sp_head_backward(cfg, 2, 0, 2, 12, lw, lb, wte, x, tok, d, lw, lb, NULL, NULL, &s),
        "head d_wte", "d_wte is NULL", NULL);
    expect_refused(
        gpt_sp_head_backward(cfg, 2, 0, 2, 12, lw, lb, wte, x, tok, d, lw, lb, wte, NULL, NULL),
        "head scratch", "scratch is NULL", NULL);
    /* No loss wanted: the targets are not read. */
    cr_expect_eq(gpt_sp_head_forward(cfg, 2, 0, 2, 12, lw, lb, wte, x, NULL, NULL, NULL, &s), 0);
    test_log_capture_stop();
    free(s.mem);
    free(d);
    free(lb);
    free(lw);
    free(x);
    free(wpe);
    free(wte);
}

/* A failed exchange is the call's answer, as the callback gave it. */
static int failing_alltoall(void *ctx, const float *send, float *recv, size_t count)
{
    int *calls = ctx;
    (void)send;
    (void)recv;
    (void)count;
    return ++*calls >= 2 ? -EIO : 0; /* recv is left as it was: the caller must not use it */
}

Test(gpt_sp, exchange_error_is_returned)
{
    struct problem pb;
    problem_make(&pb, &cfg48, 2, 12, 4);
    size_t NC = (size_t)2 * 12 * cfg48.C, nb = gpt_block_num_params(&cfg48);
    float *y = falloc(NC), *gbuf = falloc(nb);
    struct gpt_block_params p;
    struct gpt_block_grads g;
    gpt_block_params_at(&cfg48, block_of(&cfg48, pb.params), &p);
    gpt_block_grads_at(&cfg48, gbuf, &g);
    struct gpt_scratch s = {.bytes = gpt_sp_scratch_bytes(&cfg48, 1, 2, 12)};
    s.mem = calloc(1, s.bytes);
    int calls = 0;
    cr_expect_eq(
        gpt_sp_block_forward(&cfg48, 1, 0, 2, 12, &p, pb.x, y, &s, failing_alltoall, &calls), -EIO);
    cr_expect_eq(calls, 2);
    for (int fail_at = 1; fail_at <= 4; fail_at++) {
        calls = 2 - fail_at; /* the fail_at-th call of the backward answers -EIO */
        cr_expect_eq(gpt_sp_block_backward(&cfg48, 1, 0, 2, 12, &p, pb.x, pb.d_out, y, &g, &s,
                                           failing_alltoall, &calls),
                     -EIO, "exchange %d of the backward failed", fail_at);
        cr_expect_eq(calls, 2, "the backward went on after exchange %d failed", fail_at);
    }
    free(s.mem);
    free(gbuf);
    free(y);
    problem_free(&pb);
}
