/*
 * test_train_ops.c - src/train: the GPT math of gpt.h and the AdamW step of adamw.h.
 *
 * The model is checked three ways on a tiny configuration (L=2, C=16, NH=4, T=8, B=2):
 * its forward against a plain double-precision reference written here from the model's
 * definition (which also reads the parameters through the layout description); its
 * backward against central finite differences for every parameter tensor; and the
 * block-by-block path with recompute (what a trainer runs) against the whole-model
 * backward that keeps every activation. AdamW's vector and threaded kernels are compared
 * with its scalar reference (checkasm style), and its arithmetic with hand-computed values.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "train/adamw.h"
#include "train/digest.h"
#include "train/ops.h"
#include "train/gpt.h"
#include "zinf.h"

#define TB 2 /* batch */
#define TT 8 /* sequence length */
static const struct gpt_config tiny = {.V = 256, .maxT = TT, .L = 2, .C = 16, .NH = 4};

TestSuite(gpt, .fini = test_leak_check);
TestSuite(adamw, .fini = test_leak_check);

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

/* The layout of a config, allocated; *count receives the tensor count. */
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

static const float *tensor(const float *params, const struct gpt_tensor_desc *d, int n,
                           const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(d[i].name, name)) return params + d[i].offset;
    cr_assert_fail("no tensor named %s in the layout", name);
    return NULL;
}

/* GPT-2 initialisation, then every value moved by up to +-0.3 (LayerNorm weights and all
 * biases included), so that no gradient is zero by symmetry and the logits are far from
 * uniform: gradients of 1e-2..1e-1, well above the finite differences' noise. */
static float *tiny_params(uint64_t seed)
{
    size_t n = gpt_num_params(&tiny);
    float *p = falloc(n);
    cr_assert_eq(gpt_model_init(&tiny, p, seed), 0);
    uint64_t s = seed * 7 + 1;
    for (size_t i = 0; i < n; i++)
        p[i] += 0.3f * urand(&s);
    return p;
}

static void tiny_tokens(int *tok, int *tgt, uint64_t seed)
{
    uint64_t s = seed;
    for (int i = 0; i < TB * TT; i++) {
        tok[i] = (int)(test_rand(&s) % 256);
        tgt[i] = (int)(test_rand(&s) % 256);
    }
}

static struct gpt_scratch scratch_for(const struct gpt_config *cfg, int B, int T)
{
    struct gpt_scratch s = {.bytes = gpt_scratch_bytes(cfg, B, T)};
    cr_assert_gt(s.bytes, 0);
    s.mem = malloc(s.bytes);
    cr_assert_not_null(s.mem);
    return s;
}

/* max |a - b| and max |b| over n. */
static void max_diff(const float *a, const float *b, size_t n, double *diff, double *mag)
{
    *diff = 0;
    *mag = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > *diff || isnan(d)) *diff = d;
        if (fabs((double)b[i]) > *mag) *mag = fabs((double)b[i]);
    }
}

/* ---- a plain double-precision reference of the forward -------------------------------- */

static void ref_layernorm(double *out, const double *in, const float *w, const float *b, int N,
                          int C)
{
    for (int n = 0; n < N; n++) {
        double m = 0, var = 0;
        for (int c = 0; c < C; c++)
            m += in[n * C + c];
        m /= C;
        for (int c = 0; c < C; c++)
            var += (in[n * C + c] - m) * (in[n * C + c] - m);
        var /= C;
        for (int c = 0; c < C; c++)
            out[n * C + c] = (in[n * C + c] - m) / sqrt(var + 1e-5) * w[c] + b[c];
    }
}

/* out (N,OC) = in (N,IC) @ W^T + b, W (OC,IC) as PyTorch's nn.Linear stores it. */
static void ref_linear(double *out, const double *in, const float *W, const float *b, int N, int IC,
                       int OC)
{
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double acc = b[o];
            for (int i = 0; i < IC; i++)
                acc += in[n * IC + i] * W[o * IC + i];
            out[n * OC + o] = acc;
        }
}

/* Causal attention: y (B,T,C) from qkv (B,T,3C) = [q | k | v], head h at columns h*hs. */
static void ref_attention(double *y, const double *qkv, int B, int T, int C, int NH)
{
    int hs = C / NH;
    double w[TT];
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < T; i++) {
                const double *q = qkv + (b * T + i) * 3 * C + h * hs;
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j <= i; j++) {
                    const double *k = qkv + (b * T + j) * 3 * C + C + h * hs;
                    double dot = 0;
                    for (int e = 0; e < hs; e++)
                        dot += q[e] * k[e];
                    w[j] = dot / sqrt((double)hs);
                    mx = fmax(mx, w[j]);
                }
                for (int j = 0; j <= i; j++)
                    sum += (w[j] = exp(w[j] - mx));
                for (int e = 0; e < hs; e++) {
                    double acc = 0;
                    for (int j = 0; j <= i; j++)
                        acc += w[j] / sum * qkv[(b * T + j) * 3 * C + 2 * C + h * hs + e];
                    y[(b * T + i) * C + h * hs + e] = acc;
                }
            }
}

/* The mean cross-entropy of the tiny model in double; logits (B,T,V) written when given. */
static double ref_loss(const float *params, const int *tok, const int *tgt, double *logits)
{
    const int B = TB, T = TT, C = tiny.C, V = tiny.V, N = B * T;
    int nt;
    struct gpt_tensor_desc *d = layout(&tiny, &nt);
    double *x = calloc(N * C, sizeof(double)), *a = calloc(N * C, sizeof(double));
    double *big = calloc(N * 4 * C, sizeof(double)), *big2 = calloc(N * 4 * C, sizeof(double));
    double *lg = calloc(N * V, sizeof(double));
    cr_assert(x && a && big && big2 && lg);
    const float *wte = tensor(params, d, nt, "wte"), *wpe = tensor(params, d, nt, "wpe");
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            x[n * C + c] = (double)wte[tok[n] * C + c] + wpe[(n % T) * C + c];
    for (int l = 0; l < tiny.L; l++) {
        char nm[12][32];
        const float *t[12];
        const char *sfx[12] = {"ln1.w",       "ln1.b",       "attn.qkv.w", "attn.qkv.b",
                               "attn.proj.w", "attn.proj.b", "ln2.w",      "ln2.b",
                               "mlp.fc.w",    "mlp.fc.b",    "mlp.proj.w", "mlp.proj.b"};
        for (int i = 0; i < 12; i++) {
            snprintf(nm[i], sizeof(nm[i]), "h%d.%s", l, sfx[i]);
            t[i] = tensor(params, d, nt, nm[i]);
        }
        ref_layernorm(a, x, t[0], t[1], N, C);
        ref_linear(big, a, t[2], t[3], N, C, 3 * C);
        ref_attention(a, big, B, T, C, tiny.NH);
        ref_linear(big2, a, t[4], t[5], N, C, C);
        for (int i = 0; i < N * C; i++)
            x[i] += big2[i];
        ref_layernorm(a, x, t[6], t[7], N, C);
        ref_linear(big, a, t[8], t[9], N, C, 4 * C);
        for (int i = 0; i < N * 4 * C; i++) {
            double u = big[i];
            big[i] = 0.5 * u * (1 + tanh(sqrt(2 / M_PI) * (u + 0.044715 * u * u * u)));
        }
        ref_linear(big2, big, t[10], t[11], N, 4 * C, C);
        for (int i = 0; i < N * C; i++)
            x[i] += big2[i];
    }
    ref_layernorm(a, x, tensor(params, d, nt, "lnf.w"), tensor(params, d, nt, "lnf.b"), N, C);
    double loss = 0;
    for (int n = 0; n < N; n++) {
        double mx = -INFINITY, sum = 0;
        for (int v = 0; v < V; v++) {
            double acc = 0;
            for (int c = 0; c < C; c++)
                acc += a[n * C + c] * wte[v * C + c];
            lg[n * V + v] = acc;
            mx = fmax(mx, acc);
        }
        for (int v = 0; v < V; v++)
            sum += exp(lg[n * V + v] - mx);
        loss += log(sum) - (lg[n * V + tgt[n]] - mx);
    }
    if (logits) memcpy(logits, lg, sizeof(double) * N * V);
    free(x);
    free(a);
    free(big);
    free(big2);
    free(lg);
    free(d);
    return loss / N;
}

/* ---- config and layout ------------------------------------------------------------------- */

Test(gpt, config_validate_accepts_good_shapes)
{
    struct gpt_config c;
    char msg[160] = "x";
    gpt_config_defaults(&c);
    cr_expect_eq(gpt_config_validate(&c, msg, sizeof(msg)), 0);
    cr_expect_str_empty(msg);
    cr_expect_eq(c.V, 256);
    cr_expect_eq(gpt_config_validate(&tiny, NULL, 0), 0);
}

Test(gpt, config_validate_rejects_bad_shapes)
{
    struct {
        struct gpt_config c;
        const char *says;
    } bad[] = {
        {{256, 8, 2, 18, 4}, "not a multiple of NH=4"},
        {{0, 8, 2, 16, 4}, "V=0"},
        {{256, 0, 2, 16, 4}, "maxT=0"},
        {{256, 8, 0, 16, 4}, "L=0"},
        {{256, 8, 2, 0, 4}, "C=0"},
        {{256, 8, 2, 16, 0}, "NH=0"},
        {{256, 8, -1, 16, 4}, "L=-1"},
        {{256, 8, 2, 16, 32}, "not a multiple"},
        {{256, 1 << 21, 2, 16, 4}, "out of range"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char msg[160] = "";
        cr_expect_eq(gpt_config_validate(&bad[i].c, msg, sizeof(msg)), -EINVAL, "case %zu", i);
        cr_expect(strstr(msg, bad[i].says), "case %zu: message '%s' lacks '%s'", i, msg,
                  bad[i].says);
        /* Every entry point refuses the same config. */
        cr_expect_eq(gpt_layout(&bad[i].c, NULL, 0), -EINVAL);
        cr_expect_eq(gpt_scratch_bytes(&bad[i].c, 1, 1), 0);
    }
    cr_expect_eq(gpt_config_validate(NULL, NULL, 0), -EINVAL);
}

Test(gpt, layout_names_shapes_offsets)
{
    int n;
    struct gpt_tensor_desc *d = layout(&tiny, &n);
    cr_assert_eq(n, 2 + 12 * tiny.L + 2);
    cr_expect_str_eq(d[0].name, "wte");
    cr_expect_eq(d[0].shape[0], 256);
    cr_expect_eq(d[0].shape[1], 16);
    cr_expect_str_eq(d[1].name, "wpe");
    cr_expect_eq(d[1].shape[0], TT);
    cr_expect_str_eq(d[n - 2].name, "lnf.w");
    cr_expect_str_eq(d[n - 1].name, "lnf.b");
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        cr_expect_eq(d[i].offset, off, "%s", d[i].name);
        cr_expect_eq(d[i].numel, d[i].shape[0] * d[i].shape[1], "%s", d[i].name);
        cr_expect_eq(d[i].ndim, d[i].shape[1] == 1 ? 1 : 2, "%s", d[i].name);
        off += d[i].numel;
        for (int j = 0; j < i; j++)
            cr_expect_str_neq(d[i].name, d[j].name);
    }
    cr_expect_eq(off, gpt_num_params(&tiny));
    /* A block's tensors are contiguous, in slot order. */
    const struct gpt_tensor_desc *q = &d[2 + 12 + GPT_QKV_W];
    cr_expect_str_eq(q->name, "h1.attn.qkv.w");
    cr_expect_eq(q->block, 1);
    cr_expect_eq(q->slot, GPT_QKV_W);
    cr_expect_eq(q->shape[0], 48);
    cr_expect_eq(q->shape[1], 16);
    cr_expect_str_eq(d[2 + GPT_MLP_PROJ_W].name, "h0.mlp.proj.w");
    cr_expect_eq(d[2 + GPT_MLP_PROJ_W].shape[0], 16);
    cr_expect_eq(d[2 + GPT_MLP_PROJ_W].shape[1], 64);
    cr_expect_eq(d[2 + 12].offset - d[2].offset, gpt_block_num_params(&tiny));
    cr_expect_str_eq(gpt_block_slot_name(GPT_FC_B), "mlp.fc.b");
    cr_expect_null(gpt_block_slot_name(GPT_BLOCK_NSLOTS));
    /* gpt_block_params_at agrees with the offsets. */
    float *params = falloc(gpt_num_params(&tiny));
    struct gpt_block_params bp;
    gpt_block_params_at(&tiny, params + d[2 + 12].offset, &bp);
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++)
        cr_expect_eq(bp.t[s], params + d[2 + 12 + s].offset, "slot %d", s);
    /* A short array gets the first entries and the full count. */
    struct gpt_tensor_desc two[2];
    cr_expect_eq(gpt_layout(&tiny, two, 2), n);
    cr_expect_str_eq(two[1].name, "wpe");
    cr_expect_eq(gpt_layout(&tiny, NULL, 3), -EINVAL);
    free(params);
    free(d);
}

Test(gpt, init_is_gpt2_and_depends_on_name_only)
{
    struct gpt_config c = {.V = 256, .maxT = 64, .L = 8, .C = 128, .NH = 4};
    int n;
    struct gpt_tensor_desc *d = layout(&c, &n);
    float *p = falloc(gpt_num_params(&c));
    cr_assert_eq(gpt_model_init(&c, p, 42), 0);
    for (int i = 0; i < n; i++) {
        const float *t = p + d[i].offset;
        double s = 0, s2 = 0;
        for (size_t j = 0; j < d[i].numel; j++) {
            s += t[j];
            s2 += (double)t[j] * t[j];
        }
        double mean = s / d[i].numel, std = sqrt(s2 / d[i].numel - mean * mean);
        int proj = d[i].block >= 0 && (d[i].slot == GPT_ATTN_PROJ_W || d[i].slot == GPT_MLP_PROJ_W);
        if (strstr(d[i].name, "ln") && strstr(d[i].name, ".w")) {
            cr_expect(mean == 1.0 && std < 1e-6, "%s", d[i].name);
        } else if (d[i].ndim == 1) {
            cr_expect(mean == 0.0 && std == 0.0, "%s", d[i].name);
        } else {
            double want = proj ? 0.02 / sqrt(2.0 * c.L) : 0.02;
            cr_expect(fabs(std - want) < 0.1 * want, "%s: std %g, want %g", d[i].name, std, want);
            cr_expect(fabs(mean) < 0.1 * want, "%s: mean %g", d[i].name, mean);
        }
    }
    /* One tensor on its own gets the same values as in the whole-model pass. */
    const struct gpt_tensor_desc *q = &d[2 + 12 * 3 + GPT_QKV_W];
    float *one = falloc(q->numel);
    cr_assert_eq(gpt_init_tensor(&c, q, one, 42), 0);
    cr_expect_eq(memcmp(one, p + q->offset, q->numel * sizeof(float)), 0);
    cr_assert_eq(gpt_init_tensor(&c, q, one, 43), 0);
    cr_expect_neq(memcmp(one, p + q->offset, q->numel * sizeof(float)), 0);
    cr_expect_eq(gpt_init_tensor(&c, q, NULL, 42), -EINVAL);
    /* The pairs are spread over the threads; the values are those of one sequential pass of
     * the stream, for any thread count: its first and last values, drawn here in order. */
    const struct gpt_tensor_desc *fc = &d[2 + 12 * 5 + GPT_FC_W]; /* 65536 values: threaded */
    float *ref = falloc(fc->numel);
    omp_set_num_threads(1);
    cr_assert_eq(gpt_init_tensor(&c, fc, ref, 7), 0);
    for (int th = 2; th <= 3; th++) {
        omp_set_num_threads(th);
        float *got = falloc(fc->numel);
        cr_assert_eq(gpt_init_tensor(&c, fc, got, 7), 0);
        cr_expect_eq(memcmp(got, ref, fc->numel * sizeof(float)), 0, "%d threads", th);
        free(got);
    }
    omp_set_num_threads(omp_get_num_procs());
    free(ref);
    free(one);
    free(p);
    free(d);
}

/* ---- forward against the reference ---------------------------------------------------------- */

Test(gpt, forward_matches_double_reference)
{
    float *params = tiny_params(1);
    int tok[TB * TT], tgt[TB * TT];
    tiny_tokens(tok, tgt, 2);
    const size_t N = TB * TT, C = tiny.C, V = tiny.V;

    double *want_logits = calloc(N * V, sizeof(double));
    cr_assert_not_null(want_logits);
    double want = ref_loss(params, tok, tgt, want_logits);

    float loss;
    cr_assert_eq(gpt_model_forward(&tiny, TB, TT, params, tok, tgt, &loss), 0);
    cr_expect(fabs(loss - want) < 1e-5 * fabs(want), "loss %.8f, reference %.8f", loss, want);

    /* The same through the per-piece API, with the logits. */
    struct gpt_scratch s = scratch_for(&tiny, TB, TT);
    float *x = falloc(N * C), *logits = falloc(N * V);
    const float *wte = params, *wpe = params + V * C;
    const float *blocks = wpe + TT * C, *lnf = blocks + tiny.L * gpt_block_num_params(&tiny);
    cr_assert_eq(gpt_embed_forward(&tiny, TB, TT, wte, wpe, tok, x), 0);
    for (int l = 0; l < tiny.L; l++) {
        struct gpt_block_params bp;
        gpt_block_params_at(&tiny, blocks + l * gpt_block_num_params(&tiny), &bp);
        cr_assert_eq(gpt_block_forward(&tiny, TB, TT, &bp, x, x, &s), 0);
    }
    float loss2;
    cr_assert_eq(gpt_head_forward(&tiny, TB, TT, lnf, lnf + C, wte, x, tgt, &loss2, logits, &s), 0);
    cr_expect_eq(loss2, loss);
    double worst = 0;
    for (size_t i = 0; i < N * V; i++)
        worst = fmax(worst, fabs(logits[i] - want_logits[i]));
    cr_expect(worst < 1e-5, "logits differ from the reference by up to %g (tolerance 1e-5)", worst);
    free(x);
    free(logits);
    free(s.mem);
    free(want_logits);
    free(params);
}

Test(gpt, fresh_model_loss_is_near_uniform)
{
    float *params = falloc(gpt_num_params(&tiny));
    cr_assert_eq(gpt_model_init(&tiny, params, 7), 0);
    int tok[TB * TT], tgt[TB * TT];
    tiny_tokens(tok, tgt, 3);
    float loss;
    cr_assert_eq(gpt_model_forward(&tiny, TB, TT, params, tok, tgt, &loss), 0);
    cr_expect(fabs(loss - logf(256.0f)) < 0.05f, "loss %f, ln(256) = %f", loss, logf(256.0f));
    free(params);
}

Test(gpt, attention_is_causal)
{
    float *params = tiny_params(4);
    int tok[TB * TT], tgt[TB * TT];
    tiny_tokens(tok, tgt, 5);
    const size_t N = TB * TT, C = tiny.C, V = tiny.V;
    struct gpt_scratch s = scratch_for(&tiny, TB, TT);
    float *x = falloc(N * C), *a = falloc(N * V), *b = falloc(N * V);
    const float *wte = params, *wpe = params + V * C;
    const float *blocks = wpe + TT * C, *lnf = blocks + tiny.L * gpt_block_num_params(&tiny);
    for (int pass = 0; pass < 2; pass++) {
        if (pass) tok[5] = (tok[5] + 1) % 256; /* batch 0, position 5 */
        cr_assert_eq(gpt_embed_forward(&tiny, TB, TT, wte, wpe, tok, x), 0);
        for (int l = 0; l < tiny.L; l++) {
            struct gpt_block_params bp;
            gpt_block_params_at(&tiny, blocks + l * gpt_block_num_params(&tiny), &bp);
            cr_assert_eq(gpt_block_forward(&tiny, TB, TT, &bp, x, x, &s), 0);
        }
        cr_assert_eq(
            gpt_head_forward(&tiny, TB, TT, lnf, lnf + C, wte, x, NULL, NULL, pass ? b : a, &s), 0);
    }
    for (size_t n = 0; n < N; n++) {
        int same = !memcmp(a + n * V, b + n * V, V * sizeof(float));
        int t = (int)(n % TT), bi = (int)(n / TT);
        if (bi == 0 && t >= 5)
            cr_expect(!same, "position %d after the change must see it", t);
        else
            cr_expect(same, "batch %d position %d must not see position 5 of batch 0", bi, t);
    }
    free(x);
    free(a);
    free(b);
    free(s.mem);
    free(params);
}

/* ---- backward -------------------------------------------------------------------------------- */

/* Finite differences of an fp32 loss (about 6, one ulp 5e-7) over 2 eps = 0.02 carry noise
 * of about 2.5e-5 per ulp, so gradients are compared relatively down to GC_FLOOR and
 * absolutely (GC_TOL * GC_FLOOR = 1e-4) below it. Each tensor's sample is its GC_TOP largest
 * analytic gradients (where a wrong factor shows) and GC_RANDOM random elements (where a
 * gradient wrongly zero shows). Measured worst over all tensors: 2.6e-3. */
#define GC_TOP 4
#define GC_RANDOM 4
#define GC_EPS 1e-2f /* central-difference step */
#define GC_TOL 1e-2  /* largest relative error allowed */
#define GC_FLOOR 1e-2

/* The indices of the k largest |g| over n, into idx (k <= n). */
static void top_k(const float *g, size_t n, size_t *idx, int k)
{
    for (int j = 0; j < k; j++) {
        size_t best = SIZE_MAX;
        for (size_t i = 0; i < n; i++) {
            int taken = 0;
            for (int q = 0; q < j; q++)
                taken |= idx[q] == i;
            if (!taken && (best == SIZE_MAX || fabsf(g[i]) > fabsf(g[best]))) best = i;
        }
        idx[j] = best;
    }
}

Test(gpt, gradient_check_every_tensor, .timeout = 60)
{
    float *params = tiny_params(11);
    float *grads = falloc(gpt_num_params(&tiny));
    int tok[TB * TT], tgt[TB * TT];
    tiny_tokens(tok, tgt, 12);
    float loss;
    cr_assert_eq(gpt_model_backward(&tiny, TB, TT, params, tok, tgt, grads, &loss), 0);

    int n;
    struct gpt_tensor_desc *d = layout(&tiny, &n);
    uint64_t rs = 99;
    char report[4096] = "";
    size_t used = 0;
    int failed = 0;
    for (int t = 0; t < n; t++) {
        double worst = 0, w_ana = 0, w_num = 0;
        size_t w_idx = 0;
        size_t sample[GC_TOP + GC_RANDOM];
        top_k(grads + d[t].offset, d[t].numel, sample, GC_TOP);
        for (int k = GC_TOP; k < GC_TOP + GC_RANDOM; k++)
            sample[k] = test_rand(&rs) % d[t].numel;
        for (int k = 0; k < GC_TOP + GC_RANDOM; k++) {
            size_t i = d[t].offset + sample[k];
            float orig = params[i], lp, lm;
            params[i] = orig + GC_EPS;
            cr_assert_eq(gpt_model_forward(&tiny, TB, TT, params, tok, tgt, &lp), 0);
            params[i] = orig - GC_EPS;
            cr_assert_eq(gpt_model_forward(&tiny, TB, TT, params, tok, tgt, &lm), 0);
            params[i] = orig;
            /* The step actually taken, (orig+eps) - (orig-eps) in float, not 2 eps. */
            double h = (double)(orig + GC_EPS) - (double)(orig - GC_EPS);
            double num = ((double)lp - (double)lm) / h, ana = grads[i];
            double err = fabs(num - ana) / fmax(fmax(fabs(num), fabs(ana)), GC_FLOOR);
            if (err >= worst) {
                worst = err;
                w_ana = ana;
                w_num = num;
                w_idx = i - d[t].offset;
            }
        }
        if (worst > GC_TOL) {
            failed++;
            used +=
                (size_t)snprintf(report + used, used < sizeof(report) ? sizeof(report) - used : 0,
                                 " %s[%zu]: analytic %.6g numeric %.6g rel %.3g;", d[t].name, w_idx,
                                 w_ana, w_num, worst);
        }
        cr_log_info("gradcheck %-16s worst rel err %.3g", d[t].name, worst);
    }
    cr_expect_eq(failed, 0, "%d tensors over relative error %g:%s", failed, GC_TOL, report);
    free(d);
    free(grads);
    free(params);
}

/* The trainer's path: keep each block's input only, recompute inside each block's backward. */
static float blockwise_backward(const float *params, const int *tok, const int *tgt, float *grads)
{
    const size_t N = TB * TT, C = tiny.C, V = tiny.V, L = tiny.L, bf = gpt_block_num_params(&tiny);
    struct gpt_scratch s = scratch_for(&tiny, TB, TT);
    float *xs = falloc((L + 1) * N * C), *dx = falloc(N * C);
    const float *wte = params, *wpe = params + V * C, *blocks = wpe + TT * C;
    const float *lnf = blocks + L * bf;
    float *gwte = grads, *gwpe = grads + V * C, *gblocks = gwpe + TT * C, *glnf = gblocks + L * bf;
    cr_assert_eq(gpt_embed_forward(&tiny, TB, TT, wte, wpe, tok, xs), 0);
    for (size_t l = 0; l < L; l++) {
        struct gpt_block_params bp;
        gpt_block_params_at(&tiny, blocks + l * bf, &bp);
        cr_assert_eq(
            gpt_block_forward(&tiny, TB, TT, &bp, xs + l * N * C, xs + (l + 1) * N * C, &s), 0);
    }
    float loss;
    cr_assert_eq(gpt_head_backward(&tiny, TB, TT, lnf, lnf + C, wte, xs + L * N * C, tgt, dx, glnf,
                                   glnf + C, gwte, &loss, &s),
                 0);
    for (size_t l = L; l-- > 0;) {
        struct gpt_block_params bp;
        struct gpt_block_grads bg;
        gpt_block_params_at(&tiny, blocks + l * bf, &bp);
        gpt_block_grads_at(&tiny, gblocks + l * bf, &bg);
        cr_assert_eq(gpt_block_backward(&tiny, TB, TT, &bp, xs + l * N * C, dx, dx, &bg, &s), 0);
    }
    cr_assert_eq(gpt_embed_backward(&tiny, TB, TT, tok, dx, gwte, gwpe), 0);
    free(xs);
    free(dx);
    free(s.mem);
    return loss;
}

Test(gpt, block_backward_with_recompute_equals_whole_model_backward)
{
    float *params = tiny_params(21);
    size_t np = gpt_num_params(&tiny);
    float *g_model = falloc(np), *g_block = falloc(np);
    int tok[TB * TT], tgt[TB * TT];
    tiny_tokens(tok, tgt, 22);
    float l_model, l_block, l_fwd;
    cr_assert_eq(gpt_model_backward(&tiny, TB, TT, params, tok, tgt, g_model, &l_model), 0);
    l_block = blockwise_backward(params, tok, tgt, g_block);
    cr_assert_eq(gpt_model_forward(&tiny, TB, TT, params, tok, tgt, &l_fwd), 0);
    cr_expect_eq(l_model, l_fwd);
    cr_expect_eq(l_block, l_fwd);

    int n;
    struct gpt_tensor_desc *d = layout(&tiny, &n);
    for (int t = 0; t < n; t++) {
        double diff, mag;
        max_diff(g_block + d[t].offset, g_model + d[t].offset, d[t].numel, &diff, &mag);
        cr_expect(mag > 0, "%s: gradient is all zero", d[t].name);
        /* The same functions run on the same inputs: the bits agree. */
        cr_expect(diff == 0, "%s: recompute differs from kept activations by %g (max |g| %g)",
                  d[t].name, diff, mag);
    }
    /* Gradients accumulate: a second backward doubles them (to rounding: wte sums the head's
     * and the embedding's parts, in a different grouping the second time). */
    cr_assert_eq(gpt_model_backward(&tiny, TB, TT, params, tok, tgt, g_model, NULL), 0);
    double worst = 0, mag = 0;
    for (size_t i = 0; i < np; i++) {
        worst = fmax(worst, fabs((double)g_model[i] - 2.0 * g_block[i]));
        mag = fmax(mag, fabs(2.0 * g_block[i]));
    }
    cr_expect(worst <= 1e-6 * mag, "two backwards differ from twice one by %g (max |g| %g)", worst,
              mag);
    free(d);
    free(g_model);
    free(g_block);
    free(params);
}

Test(gpt, backward_is_deterministic)
{
    float *params = tiny_params(31);
    size_t np = gpt_num_params(&tiny);
    float *g1 = falloc(np), *g2 = falloc(np), *g3 = falloc(np);
    int tok[TB * TT], tgt[TB * TT];
    tiny_tokens(tok, tgt, 32);
    float l1, l2, l3;
    cr_assert_eq(gpt_model_backward(&tiny, TB, TT, params, tok, tgt, g1, &l1), 0);
    cr_assert_eq(gpt_model_backward(&tiny, TB, TT, params, tok, tgt, g2, &l2), 0);
    cr_expect_eq(memcmp(g1, g2, np * sizeof(float)), 0, "two runs gave different gradients");
    cr_expect_eq(memcmp(&l1, &l2, sizeof(float)), 0);
    /* The OpenMP loops split work by rows, heads or columns, never a sum: the bits do not
     * depend on the OpenMP thread count either. */
    int old = omp_get_max_threads();
    omp_set_num_threads(old == 1 ? 3 : 1);
    cr_assert_eq(gpt_model_backward(&tiny, TB, TT, params, tok, tgt, g3, &l3), 0);
    omp_set_num_threads(old);
    cr_expect_eq(memcmp(g1, g3, np * sizeof(float)), 0, "thread count changed the gradients");
    cr_expect_eq(memcmp(&l1, &l3, sizeof(float)), 0);
    free(g1);
    free(g2);
    free(g3);
    free(params);
}

/* The two halves of a block (the attention's and the MLP's, for a block whose MLP is a
 * mixture of experts) composed give gpt_block_forward's and gpt_block_backward's bits, and
 * each refuses what is missing of its own half only. */
Test(gpt, block_halves_compose_to_the_block_bit_for_bit)
{
    float *params = tiny_params(51);
    const size_t N = TB * TT, C = tiny.C, V = tiny.V, nb = gpt_block_num_params(&tiny);
    const float *block = params + V * C + TT * C;
    struct gpt_scratch s = scratch_for(&tiny, TB, TT);
    struct gpt_block_params bp;
    gpt_block_params_at(&tiny, block, &bp);
    float *x = falloc(N * C), *y1 = falloc(N * C), *y2 = falloc(N * C), *x2 = falloc(N * C);
    float *d = falloc(N * C), *d1 = falloc(N * C), *d2 = falloc(N * C);
    float *g1 = falloc(nb), *g2 = falloc(nb);
    for (size_t i = 0; i < N * C; i++) {
        x[i] = (float)sin(0.37 * (double)i);
        d[i] = (float)cos(0.11 * (double)i) * 0.01f;
    }
    cr_assert_eq(gpt_block_forward(&tiny, TB, TT, &bp, x, y1, &s), 0);
    /* Only its own slots: the other half's may be NULL. */
    struct gpt_block_params attn = bp, mlp = bp;
    for (int i = GPT_LN2_W; i < GPT_BLOCK_NSLOTS; i++)
        attn.t[i] = NULL;
    for (int i = 0; i < GPT_LN2_W; i++)
        mlp.t[i] = NULL;
    cr_assert_eq(gpt_attn_forward(&tiny, TB, TT, &attn, x, x2, &s), 0);
    cr_assert_eq(gpt_mlp_forward(&tiny, TB, TT, &mlp, x2, y2, &s), 0);
    cr_expect_eq(memcmp(y1, y2, N * C * sizeof(float)), 0, "the halves' forward differs");
    struct gpt_block_grads bg1, bg2;
    gpt_block_grads_at(&tiny, g1, &bg1);
    gpt_block_grads_at(&tiny, g2, &bg2);
    cr_assert_eq(gpt_block_backward(&tiny, TB, TT, &bp, x, d, d1, &bg1, &s), 0);
    float *dx2 = falloc(N * C);
    cr_assert_eq(gpt_mlp_backward(&tiny, TB, TT, &mlp, x2, d, dx2, &bg2, &s), 0);
    cr_assert_eq(gpt_attn_backward(&tiny, TB, TT, &attn, x, dx2, d2, &bg2, &s), 0);
    cr_expect_eq(memcmp(d1, d2, N * C * sizeof(float)), 0, "the halves' input gradient differs");
    cr_expect_eq(memcmp(g1, g2, nb * sizeof(float)), 0, "the halves' parameter gradients differ");
    /* In place: d_x2 may be d_out, d_in may be d_x2. */
    memset(g2, 0, nb * sizeof(float));
    memcpy(d2, d, N * C * sizeof(float));
    cr_assert_eq(gpt_mlp_backward(&tiny, TB, TT, &mlp, x2, d2, d2, &bg2, &s), 0);
    cr_assert_eq(gpt_attn_backward(&tiny, TB, TT, &attn, x, d2, d2, &bg2, &s), 0);
    cr_expect_eq(memcmp(d1, d2, N * C * sizeof(float)), 0);
    cr_expect_eq(memcmp(g1, g2, nb * sizeof(float)), 0);
    /* Bad input: a missing slot of the half, a bad shape, small scratch, aliasing. */
    struct gpt_block_params hole = attn;
    hole.t[GPT_QKV_B] = NULL;
    cr_expect_eq(gpt_attn_forward(&tiny, TB, TT, &hole, x, x2, &s), -EINVAL);
    hole = mlp;
    hole.t[GPT_MLP_PROJ_B] = NULL;
    cr_expect_eq(gpt_mlp_forward(&tiny, TB, TT, &hole, x2, y2, &s), -EINVAL);
    cr_expect_eq(gpt_mlp_forward(&tiny, TB, 0, &mlp, x2, y2, &s), -EINVAL);
    struct gpt_scratch small = {.mem = s.mem, .bytes = s.bytes - 1};
    cr_expect_eq(gpt_attn_forward(&tiny, TB, TT, &attn, x, x2, &small), -EINVAL);
    cr_expect_eq(gpt_attn_backward(&tiny, TB, TT, &attn, x, dx2, x, &bg2, &s), -EINVAL);
    cr_expect_eq(gpt_mlp_backward(&tiny, TB, TT, &mlp, x2, d, x2, &bg2, &s), -EINVAL);
    cr_expect_eq(gpt_mlp_backward(&tiny, TB, TT, &mlp, x2, d, dx2, NULL, &s), -EINVAL);
    cr_expect_eq(gpt_attn_forward(&tiny, TB, TT, &attn, NULL, x2, &s), -EINVAL);
    free(s.mem);
    free(x);
    free(y1);
    free(y2);
    free(x2);
    free(dx2);
    free(d);
    free(d1);
    free(d2);
    free(g1);
    free(g2);
    free(params);
}

Test(gpt, bad_arguments_are_einval)
{
    float *params = tiny_params(41);
    const size_t N = TB * TT, C = tiny.C, V = tiny.V;
    float *grads = falloc(gpt_num_params(&tiny)), *x = falloc(N * C), *dx = falloc(N * C);
    int tok[TB * TT], tgt[TB * TT];
    tiny_tokens(tok, tgt, 42);
    struct gpt_scratch s = scratch_for(&tiny, TB, TT);
    struct gpt_block_params bp;
    struct gpt_block_grads bg;
    const float *wte = params, *wpe = params + V * C, *blocks = wpe + TT * C;
    const float *lnf = blocks + tiny.L * gpt_block_num_params(&tiny);
    gpt_block_params_at(&tiny, blocks, &bp);
    gpt_block_grads_at(&tiny, grads + (blocks - params), &bg);
    float loss;

    /* Shapes of the call. */
    cr_expect_eq(gpt_scratch_bytes(&tiny, 0, TT), 0);
    cr_expect_eq(gpt_scratch_bytes(&tiny, TB, TT + 1), 0);
    cr_expect_eq(gpt_embed_forward(&tiny, 0, TT, wte, wpe, tok, x), -EINVAL);
    cr_expect_eq(gpt_embed_forward(&tiny, TB, TT + 1, wte, wpe, tok, x), -EINVAL);
    cr_expect_eq(gpt_block_forward(&tiny, TB, 0, &bp, x, x, &s), -EINVAL);
    cr_expect_eq(gpt_model_forward(&tiny, -1, TT, params, tok, tgt, &loss), -EINVAL);
    /* Tokens out of range, in tokens and in targets. */
    tok[3] = 256;
    cr_expect_eq(gpt_embed_forward(&tiny, TB, TT, wte, wpe, tok, x), -EINVAL);
    cr_expect_eq(gpt_embed_backward(&tiny, TB, TT, tok, dx, grads, grads + V * C), -EINVAL);
    cr_expect_eq(gpt_model_forward(&tiny, TB, TT, params, tok, tgt, &loss), -EINVAL);
    tok[3] = 0;
    tgt[7] = -1;
    cr_expect_eq(gpt_head_forward(&tiny, TB, TT, lnf, lnf + C, wte, x, tgt, &loss, NULL, &s),
                 -EINVAL);
    cr_expect_eq(gpt_head_backward(&tiny, TB, TT, lnf, lnf + C, wte, x, tgt, dx, grads, grads,
                                   grads, NULL, &s),
                 -EINVAL);
    cr_expect_eq(gpt_model_backward(&tiny, TB, TT, params, tok, tgt, grads, NULL), -EINVAL);
    tgt[7] = 0;
    /* Scratch too small or missing. */
    struct gpt_scratch small = {.mem = s.mem, .bytes = s.bytes - 1};
    cr_expect_eq(gpt_block_forward(&tiny, TB, TT, &bp, x, x, &small), -EINVAL);
    cr_expect_eq(gpt_block_backward(&tiny, TB, TT, &bp, x, dx, dx, &bg, &small), -EINVAL);
    cr_expect_eq(gpt_head_forward(&tiny, TB, TT, lnf, lnf + C, wte, x, tgt, &loss, NULL, &small),
                 -EINVAL);
    cr_expect_eq(gpt_block_forward(&tiny, TB, TT, &bp, x, x, NULL), -EINVAL);
    /* Missing tensors and pointers. */
    struct gpt_block_params bp_hole = bp;
    bp_hole.t[GPT_FC_B] = NULL;
    cr_expect_eq(gpt_block_forward(&tiny, TB, TT, &bp_hole, x, x, &s), -EINVAL);
    struct gpt_block_grads bg_hole = bg;
    bg_hole.t[GPT_LN2_W] = NULL;
    cr_expect_eq(gpt_block_backward(&tiny, TB, TT, &bp, x, dx, dx, &bg_hole, &s), -EINVAL);
    cr_expect_eq(gpt_block_backward(&tiny, TB, TT, &bp, x, dx, x, &bg, &s),
                 -EINVAL); /* d_in == x_in */
    cr_expect_eq(gpt_model_backward(&tiny, TB, TT, params, tok, tgt, NULL, NULL), -EINVAL);
    cr_expect_eq(gpt_model_forward(&tiny, TB, TT, NULL, tok, tgt, &loss), -EINVAL);
    cr_expect_eq(gpt_model_init(&tiny, NULL, 1), -EINVAL);
    /* A bad config at every entry point. */
    struct gpt_config bad = tiny;
    bad.NH = 3;
    cr_expect_eq(gpt_block_forward(&bad, TB, TT, &bp, x, x, &s), -EINVAL);
    cr_expect_eq(gpt_model_forward(&bad, TB, TT, params, tok, tgt, &loss), -EINVAL);
    /* Nothing above touched the gradients. */
    for (size_t i = 0; i < gpt_num_params(&tiny); i++)
        cr_assert_eq(grads[i], 0.0f, "element %zu written by a refused call", i);
    /* The good call works with the very same arguments. */
    cr_expect_eq(gpt_block_forward(&tiny, TB, TT, &bp, x, x, &s), 0);
    free(s.mem);
    free(grads);
    free(x);
    free(dx);
    free(params);
}

/* ---- AdamW ------------------------------------------------------------------------------------
 */

struct adam_bufs {
    size_t n;
    float *p, *g, *m, *v;
};

static struct adam_bufs adam_random(size_t n, uint64_t seed)
{
    struct adam_bufs b = {n, falloc(n), falloc(n), falloc(n), falloc(n)};
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) {
        b.p[i] = urand(&s);
        b.g[i] = 0.1f * urand(&s);
        b.m[i] = 0.01f * urand(&s);
        b.v[i] = 1e-4f * fabsf(urand(&s));
    }
    return b;
}

static struct adam_bufs adam_copy(const struct adam_bufs *a)
{
    struct adam_bufs b = {a->n, falloc(a->n), falloc(a->n), falloc(a->n), falloc(a->n)};
    memcpy(b.p, a->p, a->n * sizeof(float));
    memcpy(b.g, a->g, a->n * sizeof(float));
    memcpy(b.m, a->m, a->n * sizeof(float));
    memcpy(b.v, a->v, a->n * sizeof(float));
    return b;
}

static void adam_free(struct adam_bufs *b)
{
    free(b->p);
    free(b->g);
    free(b->m);
    free(b->v);
}

static int adam_same_bits(const struct adam_bufs *a, const struct adam_bufs *b)
{
    size_t s = a->n * sizeof(float);
    return !memcmp(a->p, b->p, s) && !memcmp(a->m, b->m, s) && !memcmp(a->v, b->v, s);
}

static const struct adamw_hparams hp = {
    .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};

/* Each vector kernel against the scalar reference, bit for bit: odd lengths (every tail
 * size, and one large enough to be split over threads), three steps with a grad scale; with
 * h's decay decoupled (AdamW) or L2 (Adam with adam_w_mode false). */
static void compare_isa_with(enum adamw_isa isa, const struct adamw_hparams *h);

static void compare_isa(enum adamw_isa isa)
{
    compare_isa_with(isa, &hp);
    struct adamw_hparams l2 = hp;
    l2.l2 = 1;
    compare_isa_with(isa, &l2);
}

static void compare_isa_with(enum adamw_isa isa, const struct adamw_hparams *h)
{
    if (adamw_update_isa(isa, NULL, NULL, NULL, NULL, 0, h, 1, 1.0f) == -ENOTSUP)
        cr_skip_test("this CPU has no %s", adamw_isa_name(isa));
    const size_t lens[] = {1, 3, 7, 9, 15, 17, 31, 33, 65537, 1000003};
    for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
        struct adam_bufs ref = adam_random(lens[li], 1000 + li), got = adam_copy(&ref);
        for (int step = 1; step <= 3; step++) {
            cr_assert_eq(adamw_update_isa(ADAMW_ISA_SCALAR, ref.p, ref.g, ref.m, ref.v, ref.n, h,
                                          step, 0.7f),
                         0);
            cr_assert_eq(adamw_update_isa(isa, got.p, got.g, got.m, got.v, got.n, h, step, 0.7f),
                         0);
        }
        /* The same IEEE operations, the same ones fused: the same bits. */
        const char *what[] = {"param", "m", "v"};
        float *r[] = {ref.p, ref.m, ref.v}, *o[] = {got.p, got.m, got.v};
        for (int k = 0; k < 3; k++) {
            double diff, mag;
            max_diff(o[k], r[k], ref.n, &diff, &mag);
            cr_expect(!memcmp(o[k], r[k], ref.n * sizeof(float)),
                      "%s%s n=%zu %s: not the scalar kernel's bits (max diff %g, max |ref| %g)",
                      adamw_isa_name(isa), h->l2 ? " (L2)" : "", ref.n, what[k], diff, mag);
        }
        adam_free(&ref);
        adam_free(&got);
    }
}

Test(adamw, avx2_matches_scalar_reference)
{
    compare_isa(ADAMW_ISA_AVX2);
}

Test(adamw, avx512_matches_scalar_reference)
{
    compare_isa(ADAMW_ISA_AVX512);
}

Test(adamw, best_is_what_the_cpu_runs)
{
    enum adamw_isa b = adamw_best_isa();
    cr_expect_neq(b, ADAMW_ISA_BEST);
    cr_expect_eq(adamw_update_isa(b, NULL, NULL, NULL, NULL, 0, &hp, 1, 1.0f), 0);
    cr_log_info("adamw kernel: %s", adamw_isa_name(ADAMW_ISA_BEST));
}

Test(adamw, same_bits_for_any_thread_count)
{
    struct adam_bufs one = adam_random(3000017, 5), two = adam_copy(&one), three = adam_copy(&one);
    omp_set_num_threads(1);
    cr_assert_eq(adamw_update(one.p, one.g, one.m, one.v, one.n, &hp, 4, 1.0f), 0);
    omp_set_num_threads(2);
    cr_assert_eq(adamw_update(two.p, two.g, two.m, two.v, two.n, &hp, 4, 1.0f), 0);
    omp_set_num_threads(3);
    cr_assert_eq(adamw_update(three.p, three.g, three.m, three.v, three.n, &hp, 4, 1.0f), 0);
    cr_expect(adam_same_bits(&one, &two), "1 and 2 threads differ");
    cr_expect(adam_same_bits(&one, &three), "1 and 3 threads differ");
    /* And run to run. */
    struct adam_bufs again = adam_random(3000017, 5);
    cr_assert_eq(adamw_update(again.p, again.g, again.m, again.v, again.n, &hp, 4, 1.0f), 0);
    cr_expect(adam_same_bits(&three, &again));
    adam_free(&one);
    adam_free(&two);
    adam_free(&three);
    adam_free(&again);
}

/* At step 1 from zero moments the bias corrections undo (1 - beta): m_hat = g and
 * v_hat = g^2, so the step is lr * g / (|g| + eps), about lr in the gradient's sign. Without
 * the corrections it would be lr * 0.1 g / (sqrt(0.05) |g|) = 0.447 lr. */
Test(adamw, bias_correction_at_step_1)
{
    const struct adamw_hparams h = {.lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f};
    for (int isa = ADAMW_ISA_SCALAR; isa <= ADAMW_ISA_BEST; isa++) {
        float p[3] = {1.0f, 1.0f, -2.0f}, g[3] = {0.5f, -2.0f, 1e-3f}, m[3] = {0}, v[3] = {0};
        int r = adamw_update_isa((enum adamw_isa)isa, p, g, m, v, 3, &h, 1, 1.0f);
        if (r == -ENOTSUP) continue;
        cr_assert_eq(r, 0);
        /* By hand: 1 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.900000002; 1 + 0.1 = 1.1;
         * -2 - 0.1 * 1e-3 / (1e-3 + 1e-8) = -2.09999900001. */
        cr_expect(fabsf(p[0] - 0.9f) < 1e-6f, "%s: %.9g", adamw_isa_name(isa), p[0]);
        cr_expect(fabsf(p[1] - 1.1f) < 1e-6f, "%s: %.9g", adamw_isa_name(isa), p[1]);
        cr_expect(fabsf(p[2] - -2.099999f) < 1e-6f, "%s: %.9g", adamw_isa_name(isa), p[2]);
        /* 1 - 0.9f is 0.100000024 in float, hence relative tolerances. */
        cr_expect(fabsf(m[0] - 0.05f) < 1e-6f * 0.05f && fabsf(v[0] - 0.0125f) < 1e-6f * 0.0125f,
                  "%s: m %.9g v %.9g", adamw_isa_name(isa), m[0], v[0]);
        /* Step 2 with the same gradient: m = 0.095 (m_hat = 0.5), v = 0.024375 (v_hat =
         * 0.25), so the step is again lr * 0.5 / 0.5. */
        r = adamw_update_isa((enum adamw_isa)isa, p, g, m, v, 1, &h, 2, 1.0f);
        cr_assert_eq(r, 0);
        cr_expect(fabsf(p[0] - 0.8f) < 1e-6f, "%s step 2: %.9g", adamw_isa_name(isa), p[0]);
    }
}

/* Decoupled decay is lr * wd * param, added outside the adaptive scaling: it acts with a
 * zero gradient, leaves m and v alone, and is the exact difference between a step with and
 * without it. (L2 decay folded into the gradient would be rescaled by 1/sqrt(v).) */
Test(adamw, weight_decay_is_decoupled)
{
    struct adamw_hparams h = {
        .lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.5f};
    for (int isa = ADAMW_ISA_SCALAR; isa <= ADAMW_ISA_BEST; isa++) {
        float p[17], g[17] = {0}, m[17] = {0}, v[17] = {0};
        for (int i = 0; i < 17; i++)
            p[i] = (float)(i - 8);
        int r = adamw_update_isa((enum adamw_isa)isa, p, g, m, v, 17, &h, 3, 1.0f);
        if (r == -ENOTSUP) continue;
        cr_assert_eq(r, 0);
        for (int i = 0; i < 17; i++) {
            float want = (float)(i - 8) * 0.95f;
            cr_expect(fabsf(p[i] - want) <= 1e-6f * fabsf(want), "%s: p[%d] = %.9g",
                      adamw_isa_name(isa), i, p[i]);
            cr_expect(m[i] == 0.0f && v[i] == 0.0f);
        }
    }
    struct adam_bufs a = adam_random(1001, 77), b = adam_copy(&a);
    float *p0 = falloc(a.n);
    memcpy(p0, a.p, a.n * sizeof(float));
    cr_assert_eq(adamw_update_isa(ADAMW_ISA_SCALAR, a.p, a.g, a.m, a.v, a.n, &h, 5, 1.0f), 0);
    h.weight_decay = 0.0f;
    cr_assert_eq(adamw_update_isa(ADAMW_ISA_SCALAR, b.p, b.g, b.m, b.v, b.n, &h, 5, 1.0f), 0);
    double worst = 0;
    for (size_t i = 0; i < a.n; i++)
        worst = fmax(worst, fabs(((double)b.p[i] - a.p[i]) - 0.1 * 0.5 * p0[i]));
    cr_expect(worst < 1e-6, "with - without decay differs from lr*wd*p by %g", worst);
    cr_expect(!memcmp(a.m, b.m, a.n * sizeof(float)) && !memcmp(a.v, b.v, a.n * sizeof(float)));
    free(p0);
    adam_free(&a);
    adam_free(&b);
}

/* Adam with adam_w_mode false: the decay is L2 in the gradient, so with a zero gradient the
 * moments see wd x param, and at step 1 the adaptive scaling turns it into about lr in the
 * parameter's sign (where AdamW's decoupled decay would be lr x wd x param). Every kernel. */
Test(adamw, l2_decay_is_in_the_gradient)
{
    struct adamw_hparams h = {
        .lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.5f, .l2 = 1};
    for (int isa = ADAMW_ISA_SCALAR; isa <= ADAMW_ISA_BEST; isa++) {
        float p[17], g[17] = {0}, m[17] = {0}, v[17] = {0};
        for (int i = 0; i < 17; i++)
            p[i] = (float)(i - 8);
        int r = adamw_update_isa((enum adamw_isa)isa, p, g, m, v, 17, &h, 1, 1.0f);
        if (r == -ENOTSUP) continue;
        cr_assert_eq(r, 0);
        for (int i = 0; i < 17; i++) {
            float p0 = (float)(i - 8), want = p0 - 0.1f * (p0 > 0 ? 1.0f : p0 < 0 ? -1.0f : 0.0f);
            cr_expect(fabsf(p[i] - want) <= 1e-6f * fabsf(want) + 1e-7f, "%s: p[%d] = %.9g, want %.9g",
                      adamw_isa_name(isa), i, p[i], want);
            float mw = (1.0f - 0.9f) * 0.5f * p0;
            cr_expect(fabsf(m[i] - mw) <= 1e-6f * fabsf(mw), "%s: m[%d] = %.9g, want %.9g",
                      adamw_isa_name(isa), i, m[i], mw);
        }
    }
}

/* bias_correction false: m and v as they are. At step 1 from zero moments the step is
 * lr x 0.1 g / (sqrt(0.05) |g|) = 0.4472 lr, not lr. */
Test(adamw, without_bias_correction_the_moments_are_used_as_they_are)
{
    struct adamw_hparams h = {
        .lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .no_bias_correction = 1};
    for (int isa = ADAMW_ISA_SCALAR; isa <= ADAMW_ISA_BEST; isa++) {
        float p[1] = {1.0f}, g[1] = {0.5f}, m[1] = {0}, v[1] = {0};
        int r = adamw_update_isa((enum adamw_isa)isa, p, g, m, v, 1, &h, 1, 1.0f);
        if (r == -ENOTSUP) continue;
        cr_assert_eq(r, 0);
        double want = 1.0 - 0.1 * (0.1 * 0.5) / (sqrt(0.05 * 0.25) + 1e-8);
        cr_expect(fabs(p[0] - want) < 2e-6, "%s: %.9g, want %.9g", adamw_isa_name(isa), p[0], want);
    }
}

/* ---- LAMB ------------------------------------------------------------------------------------ */

/* LAMB in double, DeepSpeed's formulas: the moments, u = m / (sqrt(v) + eps) + wd p, the
 * trust ratio |p| / |u| clamped, and the step lr sqrt(1 - b2^t) / (1 - b1^t) x ratio x u. */
static double lamb_reference(double *p, const float *g, double *m, double *v, size_t n,
                             const struct adamw_hparams *h, int step, double maxc, double minc)
{
    double W = 0, U = 0, *u = calloc(n, sizeof(double));
    for (size_t i = 0; i < n; i++) {
        m[i] = h->beta1 * m[i] + (1 - (double)h->beta1) * g[i];
        v[i] = h->beta2 * v[i] + (1 - (double)h->beta2) * g[i] * g[i];
        u[i] = m[i] / (sqrt(v[i]) + h->eps) + h->weight_decay * p[i];
        W += p[i] * p[i];
        U += u[i] * u[i];
    }
    double c = sqrt(W) / sqrt(U);
    c = c > maxc ? maxc : c < minc ? minc : c;
    double ss = h->lr * sqrt(1 - pow(h->beta2, step)) / (1 - pow(h->beta1, step));
    for (size_t i = 0; i < n; i++)
        p[i] -= ss * c * u[i];
    free(u);
    return c;
}

static float lamb_step(float *p, const float *g, float *m, float *v, size_t n,
                       const struct adamw_hparams *h, int step, float maxc, float minc,
                       double *w_sq, double *u_sq)
{
    size_t chunks = (n + 1023) / 1024;
    cr_assert_eq(lamb_moments(p, g, m, v, n, h, 1.0f, 0, 1024, w_sq, u_sq), 0);
    double W = 0, U = 0;
    for (size_t k = 0; k < chunks; k++) {
        W += w_sq[k];
        U += u_sq[k];
    }
    float c = lamb_coeff(W, U, maxc, minc);
    cr_assert_eq(lamb_apply(p, m, v, NULL, n, h, step, 0, c), 0);
    return c;
}

Test(lamb, matches_a_double_reference_within_and_at_its_bounds)
{
    const size_t n = 5003;
    const struct adamw_hparams h = {
        .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = 0.01f};
    const float bounds[][2] = {{10.0f, 0.0f}, {0.05f, 0.0f}, {10.0f, 5.0f}};
    for (size_t b = 0; b < 3; b++) {
        struct adam_bufs f = adam_random(n, 77);
        double *p = calloc(n, sizeof(double)), *m = calloc(n, sizeof(double)),
               *v = calloc(n, sizeof(double)), w[8], u[8];
        memset(f.m, 0, n * sizeof(float));
        memset(f.v, 0, n * sizeof(float));
        for (size_t i = 0; i < n; i++)
            p[i] = f.p[i];
        for (int step = 1; step <= 3; step++) {
            double want = lamb_reference(p, f.g, m, v, n, &h, step, bounds[b][0], bounds[b][1]);
            float got = lamb_step(f.p, f.g, f.m, f.v, n, &h, step, bounds[b][0], bounds[b][1], w, u);
            cr_expect(fabs(got - want) <= 1e-6 * want, "bounds %g..%g step %d: ratio %.9g, want %.9g",
                      bounds[b][1], bounds[b][0], step, got, want);
        }
        double diff = 0, mag = 0;
        for (size_t i = 0; i < n; i++) {
            diff = fmax(diff, fabs(f.p[i] - p[i]));
            mag = fmax(mag, fabs(p[i]));
        }
        cr_expect(diff <= 2e-6 * mag, "bounds %g..%g: param max diff %g of %g", bounds[b][1],
                  bounds[b][0], diff, mag);
        adam_free(&f);
        free(p);
        free(m);
        free(v);
    }
    /* The clamps, and 1 where a norm is 0 (a zero tensor, or nothing to move it). */
    cr_expect_eq(lamb_coeff(4.0, 1.0, 10.0f, 0.01f), 2.0f);
    cr_expect_eq(lamb_coeff(400.0, 1.0, 10.0f, 0.01f), 10.0f);
    cr_expect_eq(lamb_coeff(1e-8, 1.0, 10.0f, 0.01f), 0.01f);
    cr_expect_eq(lamb_coeff(0.0, 1.0, 10.0f, 0.01f), 1.0f);
    cr_expect_eq(lamb_coeff(1.0, 0.0, 10.0f, 0.01f), 1.0f);
}

/* The chunk sums do not depend on the thread count, nor on where the tensor is cut at a
 * chunk boundary (what each rank sums of its own part): the ratio is the same bits on one
 * rank as across ranks, and so is the update. */
Test(lamb, same_bits_for_any_thread_count_and_any_cut)
{
    const size_t n = 3000017, chunks = (n + 1023) / 1024, cut = 1024 * 1400;
    const struct adamw_hparams h = {
        .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f};
    struct adam_bufs one = adam_random(n, 9), two = adam_copy(&one), part = adam_copy(&one);
    double *w1 = calloc(chunks, sizeof(double)), *u1 = calloc(chunks, sizeof(double)),
           *w2 = calloc(chunks, sizeof(double)), *u2 = calloc(chunks, sizeof(double)),
           *w3 = calloc(chunks, sizeof(double)), *u3 = calloc(chunks, sizeof(double));
    int old = omp_get_max_threads();
    omp_set_num_threads(1);
    float c1 = lamb_step(one.p, one.g, one.m, one.v, n, &h, 2, 10.0f, 0.0f, w1, u1);
    omp_set_num_threads(3);
    float c2 = lamb_step(two.p, two.g, two.m, two.v, n, &h, 2, 10.0f, 0.0f, w2, u2);
    /* In two parts, each with its own sums, put side by side in the tensor's order. */
    cr_assert_eq(lamb_moments(part.p, part.g, part.m, part.v, cut, &h, 1.0f, 0, 1024, w3, u3), 0);
    cr_assert_eq(lamb_moments(part.p + cut, part.g + cut, part.m + cut, part.v + cut, n - cut, &h,
                              1.0f, 0, 1024, w3 + cut / 1024, u3 + cut / 1024),
                 0);
    omp_set_num_threads(old);
    cr_expect(!memcmp(w1, w2, chunks * sizeof(double)) && !memcmp(u1, u2, chunks * sizeof(double)),
              "1 and 3 threads sum differently");
    cr_expect(!memcmp(w1, w3, chunks * sizeof(double)) && !memcmp(u1, u3, chunks * sizeof(double)),
              "the parts' sums are not the whole's");
    cr_expect_eq(c1, c2);
    cr_expect(adam_same_bits(&one, &two), "1 and 3 threads differ");
    adam_free(&one);
    adam_free(&two);
    adam_free(&part);
    free(w1);
    free(u1);
    free(w2);
    free(u2);
    free(w3);
    free(u3);
}

Test(lamb, bad_arguments_are_einval)
{
    const struct adamw_hparams h = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    float p[4] = {1, 2, 3, 4}, g[4] = {1, 1, 1, 1}, m[4] = {0}, v[4] = {0};
    double w[1], u[1];
    cr_expect_eq(lamb_moments(p, g, m, v, 4, &h, 1.0f, 0, 0, w, u), -EINVAL);
    cr_expect_eq(lamb_moments(p, g, m, v, 4, &h, 1.0f, 0, 1024, NULL, u), -EINVAL);
    cr_expect_eq(lamb_moments(p, NULL, m, v, 4, &h, 1.0f, 0, 1024, w, u), -EINVAL);
    cr_expect_eq(lamb_moments(p, g, m, v, 4, &h, INFINITY, 0, 1024, w, u), -EINVAL);
    cr_expect_eq(lamb_apply(p, m, v, NULL, 4, &h, 0, 0, 1.0f), -EINVAL);
    cr_expect_eq(lamb_apply(p, m, v, NULL, 4, &h, 1, 0, NAN), -EINVAL);
    struct adamw_hparams bad = h;
    bad.beta1 = 1.0f;
    cr_expect_eq(lamb_apply(p, m, v, NULL, 4, &bad, 1, 0, 1.0f), -EINVAL);
    /* Nothing was changed by the refusals. */
    cr_expect(p[0] == 1 && p[3] == 4 && m[0] == 0 && v[0] == 0);
}

Test(adamw, clipping_sum_squares_and_scale)
{
    float g34[2] = {3.0f, -4.0f};
    double ss;
    cr_assert_eq(adamw_sum_squares(g34, 2, &ss), 0);
    cr_expect_eq(ss, 25.0);
    cr_expect_float_eq(adamw_clip_scale(ss, 1.0f), 0.2f, 1e-7);
    cr_expect_eq(adamw_clip_scale(ss, 5.0f), 1.0f);
    cr_expect_eq(adamw_clip_scale(ss, 10.0f), 1.0f);
    cr_expect_eq(adamw_clip_scale(ss, 0.0f), 1.0f); /* no clipping */
    cr_assert_eq(adamw_sum_squares(NULL, 0, &ss), 0);
    cr_expect_eq(ss, 0.0);

    /* A large buffer: against a plain double loop, and the same bits for any thread count. */
    struct adam_bufs a = adam_random(2000003, 9);
    double want = 0, s1, s3;
    for (size_t i = 0; i < a.n; i++)
        want += (double)a.g[i] * a.g[i];
    omp_set_num_threads(1);
    cr_assert_eq(adamw_sum_squares(a.g, a.n, &s1), 0);
    omp_set_num_threads(3);
    cr_assert_eq(adamw_sum_squares(a.g, a.n, &s3), 0);
    cr_expect(fabs(s1 - want) < 1e-12 * want, "sum %.17g, plain loop %.17g", s1, want);
    cr_expect(!memcmp(&s1, &s3, sizeof(double)), "1 and 3 threads: %.17g vs %.17g", s1, s3);

    /* A grad_scale is the same as scaling the gradient first. */
    float scale = adamw_clip_scale(s1, 1.0f);
    cr_expect(scale < 1.0f);
    struct adam_bufs b = adam_copy(&a);
    for (size_t i = 0; i < b.n; i++)
        b.g[i] *= scale;
    cr_assert_eq(adamw_update(a.p, a.g, a.m, a.v, a.n, &hp, 2, scale), 0);
    cr_assert_eq(adamw_update(b.p, b.g, b.m, b.v, b.n, &hp, 2, 1.0f), 0);
    cr_expect(adam_same_bits(&a, &b));
    double check;
    cr_assert_eq(adamw_sum_squares(b.g, b.n, &check), 0);
    cr_expect(fabs(sqrt(check) - 1.0) < 1e-6, "clipped norm %.9g", sqrt(check));
    adam_free(&a);
    adam_free(&b);
}

Test(adamw, bad_arguments_are_einval)
{
    float p[4] = {0}, g[4] = {0}, m[4] = {0}, v[4] = {0};
    struct adamw_hparams h;
    adamw_hparams_defaults(&h);
    cr_expect_eq(adamw_update(p, g, m, v, 4, &h, 1, 1.0f), 0);
    cr_expect_eq(adamw_update(p, g, m, v, 4, &h, 0, 1.0f), -EINVAL);
    cr_expect_eq(adamw_update(p, g, m, v, 4, NULL, 1, 1.0f), -EINVAL);
    cr_expect_eq(adamw_update(NULL, g, m, v, 4, &h, 1, 1.0f), -EINVAL);
    cr_expect_eq(adamw_update(p, g, m, NULL, 4, &h, 1, 1.0f), -EINVAL);
    cr_expect_eq(adamw_update(NULL, NULL, NULL, NULL, 0, &h, 1, 1.0f), 0);
    cr_expect_eq(adamw_update(p, g, m, v, 4, &h, 1, NAN), -EINVAL);
    cr_expect_eq(adamw_update(p, g, m, v, 4, &h, 1, INFINITY), -EINVAL);
    cr_expect_eq(adamw_update_isa((enum adamw_isa)17, p, g, m, v, 4, &h, 1, 1.0f), -EINVAL);
    struct adamw_hparams bad[] = {h, h, h, h, h, h};
    bad[0].beta1 = 1.0f;
    bad[1].beta2 = -0.1f;
    bad[2].eps = 0.0f;
    bad[3].lr = -1e-3f;
    bad[4].weight_decay = NAN;
    bad[5].lr = INFINITY;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        cr_expect_eq(adamw_update(p, g, m, v, 4, &bad[i], 1, 1.0f), -EINVAL, "case %zu", i);
    cr_expect_eq(adamw_sum_squares(NULL, 4, NULL), -EINVAL);
    double ss;
    cr_expect_eq(adamw_sum_squares(NULL, 4, &ss), -EINVAL);
    /* Refused calls wrote nothing. */
    for (int i = 0; i < 4; i++)
        cr_expect(p[i] == 0.0f && m[i] == 0.0f && v[i] == 0.0f);
}

/* ---- mixed precision ----------------------------------------------------------------------- */

Test(adamw, bf16_cast_rounds_to_nearest_even)
{
    /* 1 + 2^-8 lies halfway between two bf16 neighbours of 1: the even one (1.0) wins;
     * 1 + 3*2^-8 is halfway too and rounds up to the even 1 + 2^-6. */
    cr_assert_eq(ops_f32_to_bf16(1.0f), 0x3f80);
    cr_assert_eq(ops_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
    cr_assert_eq(ops_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
    cr_assert_eq(ops_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
    cr_assert_eq(ops_f32_to_bf16(-2.0f), 0xc000);
    cr_assert_eq(ops_f32_to_bf16(INFINITY), 0x7f80);
    cr_assert(isnan(ops_bf16_to_f32(ops_f32_to_bf16(NAN))), "NaN stays NaN");
    /* The largest finite float rounds up to infinity, as the IEEE cast does. */
    cr_assert_eq(ops_f32_to_bf16(3.4028235e38f), 0x7f80);
    for (uint32_t h = 0; h < 0x7f80; h += 7)
        cr_assert_eq(ops_f32_to_bf16(ops_bf16_to_f32((uint16_t)h)), h, "%#x round trip", h);
}

Test(adamw, update_bf16_is_the_update_then_the_cast)
{
    const size_t lens[] = {1, 17, 65537, 1000003};
    for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
        struct adam_bufs ref = adam_random(lens[li], 77 + li), got = adam_copy(&ref);
        uint16_t *w = calloc(ref.n, sizeof(uint16_t));
        for (int step = 1; step <= 2; step++) {
            cr_assert_eq(adamw_update(ref.p, ref.g, ref.m, ref.v, ref.n, &hp, step, 0.5f), 0);
            cr_assert_eq(adamw_update_bf16(got.p, got.g, got.m, got.v, w, got.n, &hp, step, 0.5f),
                         0);
        }
        cr_assert(adam_same_bits(&ref, &got), "n=%zu: the fp32 update changed", ref.n);
        for (size_t i = 0; i < ref.n; i++)
            cr_assert_eq(w[i], ops_f32_to_bf16(ref.p[i]), "n=%zu [%zu]", ref.n, i);
        /* Refused without the bf16 buffer, before anything is written. */
        cr_assert_eq(adamw_update_bf16(got.p, got.g, got.m, got.v, NULL, got.n, &hp, 3, 1.0f),
                     -EINVAL);
        cr_assert_eq(adamw_update_bf16(got.p, got.g, got.m, got.v, w, got.n, &hp, 0, 1.0f),
                     -EINVAL);
        cr_assert(adam_same_bits(&ref, &got), "n=%zu: a refused call wrote", ref.n);
        free(w);
        adam_free(&ref);
        adam_free(&got);
    }
}

/* fp16 casts against the compiler's own _Float16 conversions: every half, and a spread of
 * floats (normals, subnormals, the overflow edge, NaN and infinities). */
Test(train_ops, fp16_casts_match_the_compilers)
{
    unsigned long bad = 0, n = 0;
    for (uint64_t u = 0; u < 0x100000000ull; u += 65521) {
        uint32_t b = (uint32_t)u;
        float f;
        memcpy(&f, &b, 4);
        _Float16 h = (_Float16)f;
        uint16_t want;
        memcpy(&want, &h, 2);
        uint16_t got = ops_f32_to_f16(f);
        n++;
        if (isnan(f))
            bad += (got & 0x7c00u) != 0x7c00u || !(got & 0x3ffu);
        else
            bad += got != want;
    }
    static const float edges[] = {65504.0f, 65519.996f, 65520.0f, 1e30f, 6.1035156e-05f,
                                  5.9604645e-08f, 2.9802322e-08f, 2.9802326e-08f, 0.0f, -0.0f};
    for (size_t i = 0; i < sizeof(edges) / sizeof(edges[0]); i++) {
        _Float16 h = (_Float16)edges[i];
        uint16_t want;
        memcpy(&want, &h, 2);
        cr_expect_eq(ops_f32_to_f16(edges[i]), want, "%a: %04x, the compiler %04x", edges[i],
                     ops_f32_to_f16(edges[i]), want);
    }
    cr_expect_eq(bad, 0, "%lu of %lu floats rounded otherwise than _Float16", bad, n);
    for (uint32_t x = 0; x < 65536; x++) {
        uint16_t hb = (uint16_t)x;
        _Float16 h;
        memcpy(&h, &hb, 2);
        float want = (float)h, got = ops_f16_to_f32(hb);
        cr_assert((isnan(want) && isnan(got)) || memcmp(&want, &got, 4) == 0,
                  "%04x: %a, the compiler %a", x, got, want);
    }
}

/* ---- the AVX2 versions of GELU and attention against their scalar references ---------- */

/* max |got - ref| / (1 + |x|) over n: GELU's error scales with its input (0.5 x (1 + tanh u)
 * cancels near x = -5, so a relative bound on the output would not hold for libm either). */
static double gelu_err(const float *got, const float *ref, const float *x, size_t n, size_t *at)
{
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(ref[i]) || isnan(got[i])) {
            if (isnan(ref[i]) != isnan(got[i])) {
                *at = i;
                return INFINITY;
            }
            continue;
        }
        if (isinf(ref[i]) || isinf(got[i])) {
            if (ref[i] != got[i]) {
                *at = i;
                return INFINITY;
            }
            continue;
        }
        double e = fabs((double)got[i] - (double)ref[i]) / (1.0 + fabs((double)x[i]));
        if (e > worst) {
            worst = e;
            *at = i;
        }
    }
    return worst;
}

Test(train_ops, gelu_avx2_matches_the_reference)
{
    if (!ops_have_avx2()) return; /* nothing to compare: this CPU runs the reference */
    /* 2M points evenly over [-12, 12], 2 x 400k spaced by ratio from 1e-30 to 1e4 in both
     * signs, the values that take other paths (signed zeros, the switch between tanh's two
     * formulas, infinities, NaN), and every length of a short last block. */
    const size_t even = 2000000, geo = 400000;
    size_t n = 0, cap = even + 2 * geo + 64;
    float *x = falloc(cap), *out = falloc(cap), *ref = falloc(cap);
    float *d = falloc(cap), *dref = falloc(cap);
    for (size_t i = 0; i < even; i++)
        x[n++] = (float)(-12.0 + 24.0 * (double)i / (double)(even - 1));
    for (size_t i = 0; i < geo; i++) {
        float v = (float)pow(10.0, -30.0 + 34.0 * (double)i / (double)(geo - 1));
        x[n++] = v;
        x[n++] = -v;
    }
    static const float special[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-45f, 0.5624999f, 0.5625f,
                                    -0.5625f, 30.0f, -30.0f, 1e30f, -1e30f, INFINITY, -INFINITY,
                                    NAN, 3.0f};
    for (size_t i = 0; i < sizeof(special) / sizeof(special[0]); i++)
        x[n++] = special[i];
    uint64_t s = 77;
    for (size_t i = 0; i < n; i++) {
        d[i] = urand(&s);
        dref[i] = d[i];
    }
    cr_log_info("gelu: %zu inputs", n);
    size_t at = 0;
    for (size_t len = n - 9; len <= n; len++) { /* the last block 7..8 long, then 1..7 */
        ops_gelu_forward_avx2(out, x, len);
        ops_gelu_forward_ref(ref, x, len);
        double e = gelu_err(out, ref, x, len, &at);
        if (len == n) cr_log_info("gelu forward: worst %g at %a", e, x[at]);
        cr_assert(e <= 3e-7, "gelu forward, n %zu: error %g at x=%a (%a, the reference %a)", len,
                  e, x[at], out[at], ref[at]);
    }
    ops_gelu_backward_avx2(d, x, n);
    ops_gelu_backward_ref(dref, x, n);
    double e = gelu_err(d, dref, x, n, &at);
    cr_log_info("gelu backward: worst %g at %a", e, x[at]);
    cr_assert(e <= 3e-7, "gelu backward: error %g at x=%a (%a, the reference %a)", e, x[at], d[at],
              dref[at]);
    free(x);
    free(out);
    free(ref);
    free(d);
    free(dref);
}

static float *frand(size_t n, uint64_t seed, float scale)
{
    float *p = falloc(n);
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        p[i] = scale * urand(&s);
    return p;
}

/* One shape: forward and backward of both versions on the same qkv, compared relative to
 * the largest value of each output. */
static void check_attention_avx2(size_t B, size_t T, size_t C, size_t NH)
{
    size_t BT = B * T, natt = B * NH * T * T;
    float *qkv = frand(BT * 3 * C, 300 + T, 2.0f), *d_y = frand(BT * C, 301, 1.0f);
    float *y = falloc(BT * C), *y_ref = falloc(BT * C), *att = falloc(natt),
          *att_ref = falloc(natt), *d_qkv = frand(BT * 3 * C, 302, 9.0f),
          *d_qkv_ref = falloc(BT * 3 * C), *d_row = falloc(B * NH * T);
    ops_attention_forward_avx2(y, att, qkv, B, T, C, NH);
    ops_attention_forward_ref(y_ref, att_ref, qkv, B, T, C, NH);
    ops_attention_backward_avx2(d_qkv, d_row, d_y, qkv, att_ref, B, T, C, NH);
    ops_attention_backward_ref(d_qkv_ref, d_row, d_y, qkv, att_ref, B, T, C, NH);
    const struct {
        const char *what;
        const float *got, *ref;
        size_t n;
    } out[] = {{"y", y, y_ref, BT * C}, {"att", att, att_ref, natt}, {"d_qkv", d_qkv, d_qkv_ref, BT * 3 * C}};
    for (size_t k = 0; k < 3; k++) {
        double diff, mag;
        max_diff(out[k].got, out[k].ref, out[k].n, &diff, &mag);
        cr_expect(diff <= 2e-6 * mag,
                  "attention B %zu T %zu C %zu NH %zu, %s: max diff %g, max |ref| %g (tolerance "
                  "2e-6 relative)",
                  B, T, C, NH, out[k].what, diff, mag);
    }
    /* Above the diagonal the probabilities are exactly 0 in both. */
    for (size_t bh = 0; bh < B * NH; bh++)
        for (size_t i = 0; i < T; i++)
            for (size_t j = i + 1; j < T; j++)
                cr_assert_eq(att[(bh * T + i) * T + j], 0.0f);
    float *bufs[] = {qkv, d_y, y, y_ref, att, att_ref, d_qkv, d_qkv_ref, d_row};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        free(bufs[i]);
}

Test(train_ops, attention_avx2_matches_the_reference)
{
    if (!ops_have_avx2()) return; /* nothing to compare: this CPU runs the reference */
    check_attention_avx2(2, 13, 96, 4); /* hs 24: one 16-wide step and an 8-wide one */
    check_attention_avx2(1, 70, 128, 2); /* hs 64, rows longer than 64 keys */
    check_attention_avx2(3, 1, 32, 4);   /* hs 8, one token */
}

/* ops_gemm, GELU and attention give the same bits for 1, 2 and 3 threads (the trainer's
 * ranks run with fewer threads than one rank does, and must agree bitwise). */
Test(train_ops, same_bits_for_any_thread_count)
{
    const size_t M = 300, N = 70, K = 64; /* above the size ops_gemm splits; 2 and 3 threads cut it differently */
    const size_t B = 2, T = 33, C = 64, NH = 2, BT = B * T;
    float *A = frand(M * K, 1, 1.0f), *Bm = frand(N * K, 2, 1.0f), *Cin = frand(M * N, 3, 1.0f);
    float *x = frand(100003, 4, 6.0f), *qkv = frand(BT * 3 * C, 5, 2.0f), *d_y = frand(BT * C, 6, 1.0f);
    float *res[3][7];
    for (int t = 0; t < 3; t++) {
        omp_set_num_threads(t + 1);
        float **r = res[t];
        r[0] = falloc(M * N); /* C = A B^T + C */
        memcpy(r[0], Cin, M * N * sizeof(float));
        ops_gemm(0, 1, M, N, K, A, K, Bm, K, 1.0f, r[0], N);
        r[1] = falloc(M * N); /* C = A'^T B', A and B read as (K,M) and (K,N) */
        ops_gemm(1, 0, M, N, K, A, M, Bm, N, 0.0f, r[1], N);
        r[2] = falloc(100003);
        ops_gelu_forward(r[2], x, 100003);
        r[3] = frand(100003, 7, 1.0f);
        ops_gelu_backward(r[3], x, 100003);
        r[4] = falloc(BT * C);
        r[5] = falloc(B * NH * T * T);
        ops_attention_forward(r[4], r[5], qkv, B, T, C, NH);
        r[6] = falloc(BT * 3 * C);
        float *d_row = falloc(B * NH * T);
        ops_attention_backward(r[6], d_row, d_y, qkv, r[5], B, T, C, NH);
        free(d_row);
    }
    omp_set_num_threads(omp_get_num_procs());
    const size_t len[7] = {M * N, M * N, 100003, 100003, BT * C, B * NH * T * T, BT * 3 * C};
    const char *what[7] = {"gemm NT", "gemm TN", "gelu forward", "gelu backward",
                           "attention y", "attention att", "attention d_qkv"};
    for (int k = 0; k < 7; k++)
        for (int t = 1; t < 3; t++)
            cr_expect(!memcmp(res[0][k], res[t][k], len[k] * sizeof(float)),
                      "%s: 1 and %d threads differ", what[k], t + 1);
    /* And the GEMM is right: one element against a double sum. */
    double want = Cin[5 * N + 7];
    for (size_t k = 0; k < K; k++)
        want += (double)A[5 * K + k] * Bm[7 * K + k];
    cr_expect(fabs(res[0][0][5 * N + 7] - want) <= 1e-5 * (1 + fabs(want)), "gemm: %g, want %g",
              res[0][0][5 * N + 7], want);
    for (int t = 0; t < 3; t++)
        for (int k = 0; k < 7; k++)
            free(res[t][k]);
    free(A);
    free(Bm);
    free(Cin);
    free(x);
    free(qkv);
    free(d_y);
}

/* ops_gemm's tiles (ops_gemm_plan) cover the output once, with no gap and no overlap, come
 * from the shape alone (the same plan at any thread count), are at most 16, and are cut
 * at multiples of 16 rows and columns. Small products are one call; large ones are cut. */
Test(train_ops, gemm_tiles_cover_the_output_and_follow_the_shape)
{
    const size_t dims[] = {1, 7, 16, 33, 100, 256, 300, 488, 768, 1000, 2049, 3072};
    const size_t nd = sizeof(dims) / sizeof(dims[0]);
    for (size_t i = 0; i < nd; i++)
        for (size_t j = 0; j < nd; j++)
            for (size_t k = 0; k < nd; k += 3) {
                size_t M = dims[i], N = dims[j], K = dims[k];
                struct ops_gemm_plan p, q;
                omp_set_num_threads(1);
                ops_gemm_plan(M, N, K, &p);
                omp_set_num_threads(3);
                ops_gemm_plan(M, N, K, &q);
                cr_assert(!memcmp(&p, &q, sizeof(p)), "%zu x %zu x %zu: the plan moved", M, N, K);
                cr_assert(p.rows >= 1 && p.cols >= 1 && p.rows * p.cols <= 16, "%zu x %zu x %zu: "
                          "%u x %u tiles", M, N, K, p.rows, p.cols);
                /* Tiles cover [0, M) and [0, N) exactly: the last one starts inside. */
                cr_assert((p.rows - 1) * p.tm < M || M == 0);
                cr_assert((p.cols - 1) * p.tn < N || N == 0);
                cr_assert(p.rows * p.tm >= M && p.cols * p.tn >= N);
                cr_assert(p.rows == 1 || p.tm % 16 == 0, "%zu rows by %zu", M, p.tm);
                cr_assert(p.cols == 1 || p.tn % 16 == 0, "%zu cols by %zu", N, p.tn);
                if ((double)M * N * K < 2.0 * 16 * 1024 * 1024)
                    cr_assert_eq(p.rows * p.cols, 1, "%zu x %zu x %zu is cut", M, N, K);
            }
    omp_set_num_threads(omp_get_num_procs());
    struct ops_gemm_plan p;
    ops_gemm_plan(2048, 3072, 768, &p); /* a 12 x 768 model's fc at 16 x 128 tokens */
    cr_expect_eq(p.rows * p.cols, 16);
}

/* C = op(A) op(B) + beta C through ops_gemm at one thread, into fresh memory. */
static float *gemm_at(int threads, int ta, int tb, size_t M, size_t N, size_t K, const float *A,
                      const float *Bm, float beta, const float *Cin)
{
    float *c = falloc(M * N);
    if (beta != 0.0f) memcpy(c, Cin, M * N * sizeof(float));
    omp_set_num_threads(threads);
    ops_gemm(ta, tb, M, N, K, A, ta ? M : K, Bm, tb ? K : N, beta, c, N);
    return c;
}

/* The GEMM alone, at shapes that its plan cuts into 2 to 16 tiles (odd sizes, tiles whose
 * last row and column are short), with every transposition and both betas: 1, 2 and 3
 * threads give the same bits, and a tile's elements are right (against double sums). Also
 * from inside a parallel region, where the tiles run one after another in one thread. */
Test(train_ops, gemm_same_bits_for_any_thread_count_at_cut_shapes, .timeout = 120)
{
    const size_t shapes[][3] = {{300, 1000, 130}, {488, 640, 160}, {1000, 777, 301},
                                {2050, 1536, 17}, {97, 3000, 700}, {1543, 96, 900}};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        size_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        struct ops_gemm_plan p;
        ops_gemm_plan(M, N, K, &p);
        cr_assert_gt(p.rows * p.cols, 1, "%zu x %zu x %zu is one tile", M, N, K);
        float *A = frand(M * K, 31 + s, 1.0f), *Bm = frand(K * N, 41 + s, 1.0f),
              *Cin = frand(M * N, 51 + s, 1.0f);
        for (int tr = 0; tr < 4; tr++) {
            int ta = tr & 1, tb = tr >> 1;
            float beta = tr == 1 ? 0.0f : 1.0f;
            float *one = gemm_at(1, ta, tb, M, N, K, A, Bm, beta, Cin);
            for (int t = 2; t <= 3; t++) {
                float *c = gemm_at(t, ta, tb, M, N, K, A, Bm, beta, Cin);
                cr_expect(!memcmp(one, c, M * N * sizeof(float)),
                          "%zu x %zu x %zu, ta %d tb %d: 1 and %d threads differ", M, N, K, ta,
                          tb, t);
                free(c);
            }
            /* Nested: a parallel region around the call runs the tiles in its thread. */
            float *nested = falloc(M * N);
            if (beta != 0.0f) memcpy(nested, Cin, M * N * sizeof(float));
            omp_set_num_threads(2);
#pragma omp parallel num_threads(2)
            {
                if (omp_get_thread_num() == 1)
                    ops_gemm(ta, tb, M, N, K, A, ta ? M : K, Bm, tb ? K : N, beta, nested, N);
            }
            cr_expect(!memcmp(one, nested, M * N * sizeof(float)),
                      "%zu x %zu x %zu, ta %d tb %d: nested differs", M, N, K, ta, tb);
            /* Elements in the first tile, the last, and across a cut, against double sums. */
            size_t at[][2] = {{0, 0}, {M - 1, N - 1}, {p.tm < M ? p.tm : 0, p.tn < N ? p.tn : 0},
                              {M / 2, N / 3}};
            for (int e = 0; e < 4; e++) {
                size_t i = at[e][0], j = at[e][1];
                double want = beta != 0.0f ? Cin[i * N + j] : 0.0;
                for (size_t k = 0; k < K; k++)
                    want += (double)(ta ? A[k * M + i] : A[i * K + k]) *
                            (tb ? Bm[j * K + k] : Bm[k * N + j]);
                cr_expect(fabs(one[i * N + j] - want) <= 2e-5 * (1 + sqrt((double)K)),
                          "%zu x %zu x %zu, ta %d tb %d, (%zu,%zu): %.9g, want %.9g", M, N, K, ta,
                          tb, i, j, one[i * N + j], want);
            }
            free(nested);
            free(one);
        }
        free(A);
        free(Bm);
        free(Cin);
    }
    omp_set_num_threads(omp_get_num_procs());
}

/* The whole model's forward and backward (gpt_model_backward: every op of a step, embedding
 * to loss, the GEMMs cut where the shape says) over a sweep of shapes, odd ones among them:
 * B*T not a multiple of 8, 12, 48 or 64; C from 32 to 160; heads of 8 to 40 floats (the
 * vector attention and the scalar one). 1, 2 and 3 threads give the same loss and the same
 * bits of every gradient. */
Test(train_ops, model_same_bits_for_any_thread_count_over_shapes, .timeout = 300)
{
    const struct {
        int B, T, C, NH;
    } shapes[] = {
        {2, 32, 64, 4},  {1, 13, 32, 4},  {3, 17, 48, 2},   {2, 33, 64, 8},  {4, 23, 96, 4},
        {5, 31, 80, 10}, {8, 61, 160, 4}, {1, 100, 128, 4}, {7, 19, 120, 3}, {2, 48, 160, 5},
        {6, 11, 36, 3},  {3, 64, 144, 6}, {8, 63, 160, 8},
    };
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        struct gpt_config c = {.V = 256, .maxT = shapes[s].T, .L = 2, .C = shapes[s].C,
                               .NH = shapes[s].NH};
        int B = shapes[s].B, T = shapes[s].T;
        size_t np = gpt_num_params(&c), bt = (size_t)B * T;
        float *params = falloc(np);
        cr_assert_eq(gpt_model_init(&c, params, 5 + s), 0);
        int *tok = calloc(bt + 1, sizeof(int));
        cr_assert_not_null(tok);
        uint64_t st = 99 + s;
        for (size_t i = 0; i <= bt; i++)
            tok[i] = (int)(test_rand(&st) % 256);
        float *g[3], loss[3];
        for (int t = 0; t < 3; t++) {
            omp_set_num_threads(t + 1);
            g[t] = falloc(np);
            cr_assert_eq(gpt_model_backward(&c, B, T, params, tok, tok + 1, g[t], &loss[t]), 0);
        }
        for (int t = 1; t < 3; t++) {
            cr_expect(!memcmp(&loss[0], &loss[t], sizeof(float)),
                      "B %d T %d C %d NH %d: loss %.9g at 1 thread, %.9g at %d", B, T, c.C, c.NH,
                      loss[0], loss[t], t + 1);
            size_t first = np;
            for (size_t i = 0; i < np && first == np; i++)
                if (memcmp(&g[0][i], &g[t][i], sizeof(float))) first = i;
            cr_expect_eq(first, np, "B %d T %d C %d NH %d: gradient %zu of %zu: %.9g at 1 thread, "
                         "%.9g at %d", B, T, c.C, c.NH, first, np, first < np ? g[0][first] : 0,
                         first < np ? g[t][first] : 0, t + 1);
        }
        for (int t = 0; t < 3; t++)
            free(g[t]);
        free(tok);
        free(params);
    }
    omp_set_num_threads(omp_get_num_procs());
}

/* The parameter digest (digest.h): any one bit of any value changes it, wherever the value
 * sits in its block (first, middle, last, the odd float of a short block); it is the sum of
 * its pieces cut at blocks, as ranks cut their shards; it does not depend on the threads;
 * and the same bytes under another tensor index or block give another digest. */
Test(train_ops, digest_sees_every_bit_and_adds_up_in_pieces)
{
    const size_t n = 5 * DIGEST_BLOCK_FLOATS + 333; /* a short last block, odd length */
    float *p = frand(n, 11, 1.0f);
    uint64_t whole = digest_floats(p, n, 7, 0);
    const size_t at[] = {0, 1, 511, 1023, 1024, 2500, 5 * DIGEST_BLOCK_FLOATS, n - 2, n - 1};
    for (size_t k = 0; k < sizeof(at) / sizeof(at[0]); k++)
        for (int bit = 0; bit < 32; bit += 7) {
            uint32_t u;
            memcpy(&u, &p[at[k]], 4);
            u ^= 1u << bit;
            memcpy(&p[at[k]], &u, 4);
            cr_expect_neq(digest_floats(p, n, 7, 0), whole, "bit %d of value %zu", bit, at[k]);
            u ^= 1u << bit;
            memcpy(&p[at[k]], &u, 4);
        }
    cr_assert_eq(digest_floats(p, n, 7, 0), whole, "the bits put back, the digest is back");
    uint64_t pieces = digest_floats(p, 2 * DIGEST_BLOCK_FLOATS, 7, 0) +
                      digest_floats(p + 2 * DIGEST_BLOCK_FLOATS, DIGEST_BLOCK_FLOATS, 7, 2) +
                      digest_floats(p + 3 * DIGEST_BLOCK_FLOATS, n - 3 * DIGEST_BLOCK_FLOATS, 7, 3);
    cr_expect_eq(pieces, whole, "three pieces %016llx, whole %016llx", (unsigned long long)pieces,
                 (unsigned long long)whole);
    cr_expect_neq(digest_floats(p, n, 8, 0), whole, "another tensor index");
    cr_expect_neq(digest_floats(p, DIGEST_BLOCK_FLOATS, 7, 1),
                  digest_floats(p, DIGEST_BLOCK_FLOATS, 7, 0), "another block");
    float *big = frand(300 * DIGEST_BLOCK_FLOATS, 12, 1.0f); /* enough blocks for threads */
    uint64_t d[3];
    for (int t = 0; t < 3; t++) {
        omp_set_num_threads(t + 1);
        d[t] = digest_floats(big, 300 * DIGEST_BLOCK_FLOATS, 0, 0);
    }
    omp_set_num_threads(omp_get_num_procs());
    cr_expect(d[0] == d[1] && d[0] == d[2], "1, 2, 3 threads: %016llx %016llx %016llx",
              (unsigned long long)d[0], (unsigned long long)d[1], (unsigned long long)d[2]);
    free(p);
    free(big);
}

/* zinf.h's AdamW: torch's defaults, bitwise the library's own step with the same
 * hyper-parameters, and every bad argument refused with nothing changed. */
Test(adamw, the_public_step_is_the_trainers_and_refuses_bad_arguments)
{
    struct zinf_adamw h;
    zinf_adamw_defaults(&h);
    cr_assert(h.lr == 1e-3f && h.beta1 == 0.9f && h.beta2 == 0.999f && h.eps == 1e-8f &&
              h.weight_decay == 0.01f);
    h.beta2 = hp.beta2;
    h.weight_decay = hp.weight_decay;
    struct adam_bufs ref = adam_random(65537, 77), got = adam_copy(&ref);
    for (int step = 1; step <= 3; step++) {
        cr_assert_eq(adamw_update(ref.p, ref.g, ref.m, ref.v, ref.n, &hp, step, 0.5f), 0);
        cr_assert_eq(zinf_adamw_step(&h, step, got.p, got.g, got.m, got.v, got.n, 0.5f), 0);
    }
    cr_assert(adam_same_bits(&ref, &got), "zinf_adamw_step differs from adamw_update");

    struct adam_bufs keep = adam_copy(&got);
    struct zinf_adamw bad[6];
    for (int i = 0; i < 6; i++)
        bad[i] = h;
    bad[0].lr = -1;
    bad[1].beta1 = 1;
    bad[2].beta2 = NAN;
    bad[3].eps = 0;
    bad[4].weight_decay = -0.1f;
    bad[5].reserved[2] = 1;
    for (int i = 0; i < 6; i++)
        cr_assert_eq(zinf_adamw_step(&bad[i], 4, got.p, got.g, got.m, got.v, got.n, 1), -EINVAL,
                     "bad hyper-parameters %d", i);
    cr_assert_eq(zinf_adamw_step(NULL, 4, got.p, got.g, got.m, got.v, got.n, 1), -EINVAL);
    cr_assert_eq(zinf_adamw_step(&h, 0, got.p, got.g, got.m, got.v, got.n, 1), -EINVAL, "step 0");
    cr_assert_eq(zinf_adamw_step(&h, 4, got.p, got.g, got.m, got.v, got.n, INFINITY), -EINVAL);
    cr_assert_eq(zinf_adamw_step(&h, 4, got.p, NULL, got.m, got.v, got.n, 1), -EINVAL);
    cr_assert_eq(zinf_adamw_step(&h, 4, NULL, NULL, NULL, NULL, 0, 1), 0, "nothing to do");
    cr_assert(adam_same_bits(&keep, &got), "a refused step changed something");
    adam_free(&ref);
    adam_free(&got);
    adam_free(&keep);
}
