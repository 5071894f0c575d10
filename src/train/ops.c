/*
 * ops.c - the CPU layers of ops.h: plain loops (OpenMP over rows, heads or column blocks)
 * and cblas_sgemm for the linear layers, in the manner of llm.c's train_gpt2.c. GELU and
 * attention have AVX2 versions in ops_avx2.c, taken where the CPU has AVX2 and FMA; the
 * loops here (the _ref functions) are their references. Every reduction has a fixed order:
 * sums over rows (bias, LayerNorm and embedding gradients) are split by fixed blocks of
 * columns, each column summed by one thread from row 0 up, and GEMMs are cut into tiles
 * chosen from their shape (see ops_gemm): every split is fixed by the shape, never by the
 * thread count, so the bits do not depend on how many threads ran, or which ran what.
 *
 * Not here: argument checks (gpt.c's public functions make them), scratch layout, GPU code.
 */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <string.h>

#include "train/ops.h"

#define COL_BLOCK 64 /* columns per thread task in the sums over rows */
#define GEMM_TILE_WORK (16.0 * 1024 * 1024) /* multiply-adds per GEMM tile, at least */
#define GEMM_MAX_TILES 16u                   /* tiles of one GEMM, at most */
#define GEMM_TILE_ALIGN 16                   /* a tile's rows and columns: multiples of 16 */

/* ---- the vector versions (ops_avx2.c), where the CPU runs them ------------------------- */

int ops_have_avx2(void)
{
    /* -1 until probed; probing twice from two threads gives the same answer. */
    static int have = -1;
    int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
    if (h < 0) {
        __builtin_cpu_init();
        h = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        __atomic_store_n(&have, h, __ATOMIC_RELAXED);
    }
    return h;
}

void ops_gelu_forward(float *out, const float *inp, size_t n)
{
    if (ops_have_avx2())
        ops_gelu_forward_avx2(out, inp, n);
    else
        ops_gelu_forward_ref(out, inp, n);
}

void ops_gelu_backward(float *d, const float *inp, size_t n)
{
    if (ops_have_avx2())
        ops_gelu_backward_avx2(d, inp, n);
    else
        ops_gelu_backward_ref(d, inp, n);
}

/* The vector attention works on whole heads of 8-float groups. */
void ops_attention_forward(float *y, float *att, const float *qkv, size_t B, size_t T, size_t C,
                           size_t NH)
{
    if (ops_have_avx2() && (C / NH) % 8 == 0)
        ops_attention_forward_avx2(y, att, qkv, B, T, C, NH);
    else
        ops_attention_forward_ref(y, att, qkv, B, T, C, NH);
}

void ops_attention_backward(float *d_qkv, float *d_row, const float *d_y, const float *qkv,
                            const float *att, size_t B, size_t T, size_t C, size_t NH)
{
    if (ops_have_avx2() && (C / NH) % 8 == 0)
        ops_attention_backward_avx2(d_qkv, d_row, d_y, qkv, att, B, T, C, NH);
    else
        ops_attention_backward_ref(d_qkv, d_row, d_y, qkv, att, B, T, C, NH);
}

/* ---- GEMM on the OpenMP threads -------------------------------------------------------- */

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;

/* OpenBLAS's own threads (the pthread build Debian selects first) spin with sched_yield for
 * ~0.1 s after each call; between the GEMMs of a step they took the CPUs from the OpenMP
 * threads that run every other layer, a quarter of a 2-CPU step. So OpenBLAS runs in the
 * calling thread, and ops_gemm spreads a GEMM over the OpenMP threads itself. */
static void blas_single_threaded(void)
{
    openblas_set_num_threads(1);
}

/* The tiles of a GEMM's output, chosen from its shape alone (see ops_gemm). The output
 * (M,N) is cut into a grid of rows x cols tiles, each tm rows by tn columns but the last of
 * a row or column of the grid, which is the remainder. */
void ops_gemm_plan(size_t M, size_t N, size_t K, struct ops_gemm_plan *p)
{
    static const unsigned counts[] = {1, 2, 4, 6, 8, 12, GEMM_MAX_TILES};
    double work = (double)M * (double)N * (double)K;
    unsigned want = 1;
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++)
        if (work >= (double)counts[i] * GEMM_TILE_WORK) want = counts[i];
    /* Each tile packs its share of both operands: a grid of r x c tiles packs op(A) (M,K)
     * c times and op(B) (K,N) r times. Of the grids of want tiles, the one that packs least
     * (the first found on a tie, so the choice is a function of the shape). */
    unsigned rows = 1, cols = 1;
    double best = -1.0;
    for (unsigned r = 1; r <= want; r++) {
        if (want % r) continue;
        unsigned c = want / r;
        if (r > 1 && M / r < GEMM_TILE_ALIGN) continue;
        if (c > 1 && N / c < GEMM_TILE_ALIGN) continue;
        double cost = (double)c * (double)M + (double)r * (double)N;
        if (best < 0 || cost < best) {
            best = cost;
            rows = r;
            cols = c;
        }
    }
    size_t tm = (M + rows - 1) / rows, tn = (N + cols - 1) / cols;
    tm = (tm + GEMM_TILE_ALIGN - 1) / GEMM_TILE_ALIGN * GEMM_TILE_ALIGN;
    tn = (tn + GEMM_TILE_ALIGN - 1) / GEMM_TILE_ALIGN * GEMM_TILE_ALIGN;
    p->tm = tm < M ? tm : (M ? M : 1);
    p->tn = tn < N ? tn : (N ? N : 1);
    p->rows = (unsigned)((M + p->tm - 1) / p->tm);
    p->cols = (unsigned)((N + p->tn - 1) / p->tn);
    if (!p->rows) p->rows = 1;
    if (!p->cols) p->cols = 1;
}

/* Row-major C (M,N) = op(A) (M,K) @ op(B) (K,N) + beta * C, with op transposing when ta (tb)
 * is set.
 *
 * Why the bits depend on the shape alone. ops_gemm_plan cuts C into tiles from (M,N,K)
 * only, never from the thread count. Each tile is one sequential cblas_sgemm over all of K:
 * its elements are whatever OpenBLAS makes of that call's shape and values on this CPU's
 * kernels, however it blocks, packs or orders the sum inside the call (OpenBLAS runs in the
 * calling thread, openblas_set_num_threads(1), so no call is split further by it). A tile
 * writes only its own elements of C and reads only A, B and those elements, so it does not
 * matter which thread runs it, or when, or whether the tiles run one after another (inside
 * another parallel region, or on one thread). Nothing here assumes that a cut leaves
 * OpenBLAS's bits alone: a cut does change them on some kernels, and it is the same cut on
 * every run of the same shape. What is assumed is only that one single-threaded OpenBLAS
 * call is a function of its arguments' values (not of their addresses or of the time).
 * tests/test_train_ops.c checks this over a sweep of shapes at 1, 2 and 3 threads.
 * The tiles are few (at most GEMM_MAX_TILES), each at least GEMM_TILE_WORK multiply-adds
 * where there are several: every tile repacks its share of op(A) and op(B), and OpenBLAS
 * loses speed on narrow calls; the threads take them as they come free. */
void ops_gemm(int ta, int tb, size_t M, size_t N, size_t K, const float *A, size_t lda,
              const float *B, size_t ldb, float beta, float *C, size_t ldc)
{
    pthread_once(&blas_once, blas_single_threaded);
    enum CBLAS_TRANSPOSE oa = ta ? CblasTrans : CblasNoTrans, ob = tb ? CblasTrans : CblasNoTrans;
    struct ops_gemm_plan p;
    ops_gemm_plan(M, N, K, &p);
    size_t tiles = (size_t)p.rows * p.cols;
    if (tiles <= 1) {
        cblas_sgemm(CblasRowMajor, oa, ob, (int)M, (int)N, (int)K, 1.0f, A, (int)lda, B, (int)ldb,
                    beta, C, (int)ldc);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) if (!omp_in_parallel())
    for (size_t s = 0; s < tiles; s++) {
        size_t r0 = s / p.cols * p.tm, c0 = s % p.cols * p.tn;
        size_t m = M - r0 < p.tm ? M - r0 : p.tm, n = N - c0 < p.tn ? N - c0 : p.tn;
        const float *a = ta ? A + r0 : A + r0 * lda; /* op(A)'s rows r0.. */
        const float *b = tb ? B + c0 * ldb : B + c0; /* op(B)'s columns c0.. */
        cblas_sgemm(CblasRowMajor, oa, ob, (int)m, (int)n, (int)K, 1.0f, a, (int)lda, b, (int)ldb,
                    beta, C + r0 * ldc + c0, (int)ldc);
    }
}

/* out (N,C) = (inp (N,C) - mean) * rstd * w (C) + b (C); mean and rstd (N) are kept for
 * the backward. */
void ops_layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *w,
                           const float *b, size_t N, size_t C)
{
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        const float *x = inp + n * C;
        float *o = out + n * C;
        float m = 0.0f, var = 0.0f;
        for (size_t i = 0; i < C; i++)
            m += x[i];
        m /= (float)C;
        for (size_t i = 0; i < C; i++) {
            float d = x[i] - m;
            var += d * d;
        }
        var /= (float)C;
        float s = 1.0f / sqrtf(var + OPS_LN_EPS);
        for (size_t i = 0; i < C; i++)
            o[i] = (x[i] - m) * s * w[i] + b[i];
        mean[n] = m;
        rstd[n] = s;
    }
}

/* dw, db (C) += the LayerNorm's parameter gradients; d_inp (N,C) = (or += when accumulate)
 * the gradient of its input. d_inp may be inp: the parameter gradients, which read inp for
 * every row, are done first, and the input gradient of a row reads inp[i] before it writes
 * d_inp[i]. */
void ops_layernorm_backward(float *d_inp, int accumulate, float *dw, float *db, const float *d_out,
                            const float *inp, const float *w, const float *mean, const float *rstd,
                            size_t N, size_t C)
{
    size_t nblk = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t blk = 0; blk < nblk; blk++) {
        size_t c0 = blk * COL_BLOCK, c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;
        for (size_t n = 0; n < N; n++) {
            const float *x = inp + n * C, *d = d_out + n * C;
            float m = mean[n], s = rstd[n];
            for (size_t c = c0; c < c1; c++) {
                dw[c] += d[c] * ((x[c] - m) * s);
                db[c] += d[c];
            }
        }
    }
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        const float *x = inp + n * C, *d = d_out + n * C;
        float *dx = d_inp + n * C;
        float m = mean[n], s = rstd[n];
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (size_t i = 0; i < C; i++) {
            float dnorm = w[i] * d[i];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * ((x[i] - m) * s);
        }
        dnorm_mean /= (float)C;
        dnorm_norm_mean /= (float)C;
        for (size_t i = 0; i < C; i++) {
            float norm = (x[i] - m) * s;
            float v = s * (w[i] * d[i] - dnorm_mean - norm * dnorm_norm_mean);
            dx[i] = accumulate ? dx[i] + v : v;
        }
    }
}

/* out (N,OC) = [residual (N,OC) +] b (OC) + inp (N,IC) @ W^T, W being (OC,IC). Folding the
 * residual add into the GEMM's accumulate saves a pass and a buffer. */
void ops_linear_forward(float *out, const float *inp, const float *W, const float *b,
                        const float *residual, size_t N, size_t IC, size_t OC)
{
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        float *o = out + n * OC;
        const float *r = residual ? residual + n * OC : NULL;
        for (size_t j = 0; j < OC; j++)
            o[j] = (r ? r[j] : 0.0f) + b[j];
    }
    ops_gemm(0, 1, N, OC, IC, inp, IC, W, IC, 1.0f, out, OC);
}

/* acc (OC) += the sum over the N rows of x (N,OC), each column in row order. */
void ops_colsum_acc(float *acc, const float *x, size_t N, size_t OC)
{
    size_t nblk = (OC + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t blk = 0; blk < nblk; blk++) {
        size_t c0 = blk * COL_BLOCK, c1 = c0 + COL_BLOCK < OC ? c0 + COL_BLOCK : OC;
        for (size_t n = 0; n < N; n++)
            for (size_t c = c0; c < c1; c++)
                acc[c] += x[n * OC + c];
    }
}

/* d_inp (N,IC) = d_out (N,OC) @ W (OC,IC); dW (OC,IC) += d_out^T @ inp (N,IC);
 * db (OC) += the column sums of d_out. */
void ops_linear_backward(float *d_inp, float *dW, float *db, const float *d_out, const float *inp,
                         const float *W, size_t N, size_t IC, size_t OC)
{
    ops_gemm(0, 0, N, IC, OC, d_out, OC, W, IC, 0.0f, d_inp, IC);
    ops_gemm(1, 0, OC, IC, N, d_out, OC, inp, IC, 1.0f, dW, IC);
    if (db)
        ops_colsum_acc(db, d_out, N, OC);
}

#define GELU_SCALE 0.7978845608028654f /* sqrt(2/pi) */

/* out (n) = GELU(inp (n)), the tanh approximation GPT-2 uses. */
void ops_gelu_forward_ref(float *out, const float *inp, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_SCALE * (x + 0.044715f * x * x * x);
        out[i] = 0.5f * x * (1.0f + tanhf(u));
    }
}

/* d (n) *= GELU'(inp (n)), in place: d enters as dloss/dout and leaves as dloss/dinp. */
void ops_gelu_backward_ref(float *d, const float *inp, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_SCALE * (x + 0.044715f * x * x * x);
        float th = tanhf(u);
        float du = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        d[i] *= 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
    }
}

/* Causal self-attention. qkv (B,T,3C) holds q, k and v side by side, head h at columns
 * h*hs of each. att (B,NH,T,T) receives the softmax probabilities (zero above the
 * diagonal); y (B,T,C) the heads' outputs side by side. One (b,h) per thread task. */
void ops_attention_forward_ref(float *y, float *att, const float *qkv, size_t B, size_t T, size_t C,
                           size_t NH)
{
    size_t hs = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for collapse(2) schedule(static)
    for (size_t b = 0; b < B; b++) {
        for (size_t h = 0; h < NH; h++) {
            const float *base = qkv + b * T * C3 + h * hs;
            float *att_bh = att + (b * NH + h) * T * T;
            for (size_t i = 0; i < T; i++) {
                const float *q = base + i * C3;
                float *row = att_bh + i * T;
                float mx = -INFINITY;
                for (size_t j = 0; j <= i; j++) {
                    const float *k = base + j * C3 + C;
                    float dot = 0.0f;
                    for (size_t e = 0; e < hs; e++)
                        dot += q[e] * k[e];
                    dot *= scale;
                    row[j] = dot;
                    if (dot > mx) mx = dot;
                }
                float sum = 0.0f;
                for (size_t j = 0; j <= i; j++) {
                    row[j] = expf(row[j] - mx);
                    sum += row[j];
                }
                float inv = 1.0f / sum;
                for (size_t j = 0; j <= i; j++)
                    row[j] *= inv;
                for (size_t j = i + 1; j < T; j++)
                    row[j] = 0.0f;
                float *out = y + (b * T + i) * C + h * hs;
                for (size_t e = 0; e < hs; e++)
                    out[e] = 0.0f;
                for (size_t j = 0; j <= i; j++) {
                    const float *v = base + j * C3 + 2 * C;
                    float a = row[j];
                    for (size_t e = 0; e < hs; e++)
                        out[e] += a * v[e];
                }
            }
        }
    }
}

/* d_qkv (B,T,3C) = the gradient of attention_forward's input, given d_y (B,T,C), the
 * input qkv and the probabilities att (B,NH,T,T). d_row (B,NH,T) is room for one row of
 * dloss/datt per (b,h). Each (b,h) writes only its own columns of d_qkv. */
void ops_attention_backward_ref(float *d_qkv, float *d_row, const float *d_y, const float *qkv,
                            const float *att, size_t B, size_t T, size_t C, size_t NH)
{
    size_t hs = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);
    memset(d_qkv, 0, B * T * C3 * sizeof(float));
#pragma omp parallel for collapse(2) schedule(static)
    for (size_t b = 0; b < B; b++) {
        for (size_t h = 0; h < NH; h++) {
            const float *base = qkv + b * T * C3 + h * hs;
            float *dbase = d_qkv + b * T * C3 + h * hs;
            const float *att_bh = att + (b * NH + h) * T * T;
            float *datt = d_row + (b * NH + h) * T;
            for (size_t i = 0; i < T; i++) {
                const float *dy = d_y + (b * T + i) * C + h * hs;
                const float *row = att_bh + i * T;
                float dot_sum = 0.0f; /* sum_j att[i][j] * datt[j] */
                for (size_t j = 0; j <= i; j++) {
                    const float *v = base + j * C3 + 2 * C;
                    float *dv = dbase + j * C3 + 2 * C;
                    float d = 0.0f;
                    for (size_t e = 0; e < hs; e++) {
                        d += dy[e] * v[e];
                        dv[e] += row[j] * dy[e];
                    }
                    datt[j] = d;
                    dot_sum += row[j] * d;
                }
                const float *q = base + i * C3;
                float *dq = dbase + i * C3;
                for (size_t j = 0; j <= i; j++) {
                    const float *k = base + j * C3 + C;
                    float *dk = dbase + j * C3 + C;
                    float dpre = row[j] * (datt[j] - dot_sum) * scale;
                    for (size_t e = 0; e < hs; e++) {
                        dq[e] += dpre * k[e];
                        dk[e] += dpre * q[e];
                    }
                }
            }
        }
    }
}

void ops_embed_forward(float *x, const float *wte, const float *wpe, const int *tokens, size_t B,
                       size_t T, size_t C)
{
    size_t N = B * T;
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        const float *te = wte + (size_t)tokens[n] * C, *pe = wpe + (n % T) * C;
        float *o = x + n * C;
        for (size_t c = 0; c < C; c++)
            o[c] = te[c] + pe[c];
    }
}

/* Rows that share a token (or a position) add into the same row of d_wte (d_wpe), so the
 * work is split by columns and each column is summed over (b,t) in order. */
void ops_embed_backward(float *d_wte, float *d_wpe, const float *d_x, const int *tokens, size_t B,
                        size_t T, size_t C)
{
    size_t N = B * T, nblk = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t blk = 0; blk < nblk; blk++) {
        size_t c0 = blk * COL_BLOCK, c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;
        for (size_t n = 0; n < N; n++) {
            const float *g = d_x + n * C;
            float *te = d_wte + (size_t)tokens[n] * C, *pe = d_wpe + (n % T) * C;
            for (size_t c = c0; c < c1; c++) {
                te[c] += g[c];
                pe[c] += g[c];
            }
        }
    }
}

/* out = a + b. */
void ops_add(float *out, const float *a, const float *b, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        out[i] = a[i] + b[i];
}

/* Each row's normaliser and the mean are summed in double, in a fixed order. */
float ops_crossentropy(float *logits, float *losses, const int *targets, size_t N, size_t V,
                       int want_grad)
{
#pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        float *l = logits + n * V;
        float mx = -INFINITY;
        for (size_t j = 0; j < V; j++)
            if (l[j] > mx) mx = l[j];
        double sum = 0.0;
        for (size_t j = 0; j < V; j++)
            sum += (double)expf(l[j] - mx);
        int tgt = targets[n];
        losses[n] = (float)(log(sum) - (double)(l[tgt] - mx));
        if (want_grad) {
            float inv = (float)(1.0 / sum), invN = 1.0f / (float)N;
            for (size_t j = 0; j < V; j++) {
                float prob = expf(l[j] - mx) * inv;
                l[j] = (prob - (j == (size_t)tgt ? 1.0f : 0.0f)) * invN;
            }
        }
    }
    double total = 0.0;
    for (size_t n = 0; n < N; n++)
        total += losses[n];
    return (float)(total / (double)N);
}

void ops_cast_f32_to_bf16(uint16_t *dst, const float *src, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        dst[i] = ops_f32_to_bf16(src[i]);
}

void ops_cast_bf16_to_f32(float *dst, const uint16_t *src, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        dst[i] = ops_bf16_to_f32(src[i]);
}

uint16_t ops_f32_to_f16(float f)
{
    return half_from_f32(f);
}

float ops_f16_to_f32(uint16_t h)
{
    return half_to_f32(h);
}

void ops_cast_f32_to_f16(uint16_t *dst, const float *src, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        dst[i] = ops_f32_to_f16(src[i]);
}

void ops_cast_f16_to_f32(float *dst, const uint16_t *src, size_t n)
{
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        dst[i] = ops_f16_to_f32(src[i]);
}
