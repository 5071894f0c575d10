/*
 * gpt_lora.c - a GPT block with low-rank adapters on a frozen base (gpt_lora.h), on the CPU.
 *
 * The block is gpt.c's, composed from the same ops in the same order, with each targeted
 * linear followed by its adapter's share. The backward pulls the gradient through the base
 * weights without computing theirs (the LayerNorms' weight gradients go to a throwaway row:
 * ops_layernorm_backward always writes them), and through the adapters computing theirs:
 *   h = x A^T (N,r), hs = scale h;  y += hs B^T
 *   dB += dy^T hs;  dh = scale (dy B);  dA += dh^T x;  dx += dh A
 * h is recomputed in the backward from the linear's input, which the recomputed block holds.
 *
 * Not here: the adapters' homes and updates (the trainer), GPU code.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "train/gpt_lora.h"
#include "train/ops.h"

#define ALIGN_FLOATS 16
#define SCRATCH_ALIGN_BYTES 64

static const struct {
    int slot;
    const char *hf;   /* the module under a block in HF's GPT-2 */
    const char *peft; /* PEFT's target_modules name */
} targets[GPT_LORA_NTARGETS] = {
    [GPT_LORA_QKV] = {GPT_QKV_W, "attn.c_attn", "c_attn"},
    [GPT_LORA_ATTN_PROJ] = {GPT_ATTN_PROJ_W, "attn.c_proj", "c_proj"},
    [GPT_LORA_FC] = {GPT_FC_W, "mlp.c_fc", "c_fc"},
    [GPT_LORA_MLP_PROJ] = {GPT_MLP_PROJ_W, "mlp.c_proj", "c_proj"},
};

int gpt_lora_slot(int j)
{
    return j >= 0 && j < GPT_LORA_NTARGETS ? targets[j].slot : -1;
}

void gpt_lora_dims(const struct gpt_config *cfg, int j, size_t *out, size_t *in)
{
    size_t C = (size_t)cfg->C;
    *out = j == GPT_LORA_QKV ? 3 * C : j == GPT_LORA_FC ? 4 * C : C;
    *in = j == GPT_LORA_MLP_PROJ ? 4 * C : C;
}

const char *gpt_lora_hf_module(int j)
{
    return j >= 0 && j < GPT_LORA_NTARGETS ? targets[j].hf : NULL;
}

void gpt_lora_name(int k, int j, int ab, char *buf, size_t len)
{
    const char *base = gpt_block_slot_name(gpt_lora_slot(j)); /* "attn.qkv.w" */
    snprintf(buf, len, "h%d.%.*s.lora_%c", k, base ? (int)strlen(base) - 2 : 0, base ? base : "",
             ab ? 'b' : 'a');
}

int gpt_lora_parse_targets(const char *list)
{
    unsigned mask = 0;
    const char *s = list;
    if (!s || !*s) return -EINVAL;
    while (*s) {
        size_t n = strcspn(s, ",");
        unsigned m = 0;
        for (int j = 0; j < GPT_LORA_NTARGETS; j++)
            if (n == strlen(targets[j].peft) && !strncmp(s, targets[j].peft, n)) m |= 1u << j;
        if (!m) return -EINVAL; /* an unknown name, or an empty one (",,") */
        mask |= m;
        s += n;
        if (*s == ',' && !*++s) return -EINVAL; /* a trailing comma */
    }
    return (int)mask;
}

const char *gpt_lora_targets_name(unsigned mask, char *buf, size_t len)
{
    static const char *const names[] = {"c_attn", "c_proj", "c_fc"};
    const unsigned bits[] = {1u << GPT_LORA_QKV,
                             (1u << GPT_LORA_ATTN_PROJ) | (1u << GPT_LORA_MLP_PROJ),
                             1u << GPT_LORA_FC};
    size_t at = 0;
    if (len) buf[0] = 0;
    for (int i = 0; i < 3; i++)
        if ((mask & bits[i]) && at < len)
            at += (size_t)snprintf(buf + at, len - at, "%s%s", at ? "," : "", names[i]);
    return buf;
}

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void gpt_lora_init_a(const struct gpt_config *cfg, int k, int j, int r, float *a, uint64_t seed)
{
    size_t out, in;
    gpt_lora_dims(cfg, j, &out, &in);
    /* torch's kaiming_uniform_(a=sqrt(5)) on (r, in): gain sqrt(2 / (1 + 5)), bound
     * gain * sqrt(3 / in) = 1 / sqrt(in). Element i's draw is a hash of its counter. */
    double bound = 1.0 / sqrt((double)in);
    uint64_t base = mix64(seed ^ 0x4c6f5241ull ^ ((uint64_t)k << 20) ^ ((uint64_t)j << 8));
    size_t n = (size_t)r * in;
    for (size_t i = 0; i < n; i++) {
        double u = (double)(mix64(base + (uint64_t)i * 0x9e3779b97f4a7c15ull) >> 11) *
                   (1.0 / 9007199254740992.0);
        a[i] = (float)((2.0 * u - 1.0) * bound);
    }
}

/* ---- scratch ------------------------------------------------------------------------------ */

struct lora_acts {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty, *x2, *ln2, *ln2_mean, *ln2_rstd, *fch,
        *fch_gelu;
    float *d_x2, *d_big, *d_small, *d_row;
    float *h, *dh; /* (N,r): an adapter's x A^T (times scale), and its gradient */
    float *dln;    /* (2C): the frozen LayerNorms' weight gradients, thrown away */
};

static float *take(float *base, size_t *off, size_t n)
{
    float *p = base ? base + *off : NULL;
    *off += (n + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
    return p;
}

static size_t carve(struct lora_acts *a, float *base, size_t B, size_t T, size_t C, size_t NH,
                    size_t r)
{
    size_t N = B * T, NC = N * C, off = 0;
    a->ln1 = take(base, &off, NC);
    a->ln1_mean = take(base, &off, N);
    a->ln1_rstd = take(base, &off, N);
    a->qkv = take(base, &off, 3 * NC);
    a->att = take(base, &off, B * NH * T * T);
    a->atty = take(base, &off, NC);
    a->x2 = take(base, &off, NC);
    a->ln2 = take(base, &off, NC);
    a->ln2_mean = take(base, &off, N);
    a->ln2_rstd = take(base, &off, N);
    a->fch = take(base, &off, 4 * NC);
    a->fch_gelu = take(base, &off, 4 * NC);
    a->d_x2 = take(base, &off, NC);
    a->d_big = take(base, &off, 4 * NC);
    a->d_small = take(base, &off, NC);
    a->d_row = take(base, &off, B * NH * T);
    a->h = take(base, &off, N * r);
    a->dh = take(base, &off, N * r);
    a->dln = take(base, &off, 2 * C);
    return off;
}

size_t gpt_lora_scratch_bytes(const struct gpt_config *cfg, int B, int T, int r)
{
    struct lora_acts a;
    if (gpt_config_validate(cfg, NULL, 0) < 0 || B < 1 || T < 1 || r < 1) return 0;
    return carve(&a, NULL, (size_t)B, (size_t)T, (size_t)cfg->C, (size_t)cfg->NH, (size_t)r) *
               sizeof(float) +
           SCRATCH_ALIGN_BYTES;
}

static int check(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                 const struct gpt_lora_params *l, struct gpt_scratch *s, struct lora_acts *a)
{
    if (gpt_config_validate(cfg, NULL, 0) < 0 || B < 1 || T < 1 || T > cfg->maxT ||
        (long long)B * T > INT_MAX / 4 || !p || !l || l->r < 1 || !s || !s->mem)
        return -EINVAL;
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++)
        if (!p->t[i]) return -EINVAL;
    for (int j = 0; j < GPT_LORA_NTARGETS; j++)
        if (!l->a[j] != !l->b[j]) return -EINVAL;
    if (s->bytes < gpt_lora_scratch_bytes(cfg, B, T, l->r)) return -EINVAL;
    uintptr_t at =
        ((uintptr_t)s->mem + SCRATCH_ALIGN_BYTES - 1) & ~(uintptr_t)(SCRATCH_ALIGN_BYTES - 1);
    carve(a, (float *)at, (size_t)B, (size_t)T, (size_t)cfg->C, (size_t)cfg->NH, (size_t)l->r);
    return 0;
}

/* ---- the block ---------------------------------------------------------------------------- */

/* y (N,out) += scale (x A^T) B^T for target j, when it has an adapter. */
static void adapter_forward(const struct gpt_config *cfg, const struct gpt_lora_params *l, int j,
                            float *y, const float *x, size_t N, struct lora_acts *a)
{
    if (!l->a[j]) return;
    size_t out, in, r = (size_t)l->r;
    gpt_lora_dims(cfg, j, &out, &in);
    ops_gemm(0, 1, N, r, in, x, in, l->a[j], in, 0.0f, a->h, r);
    for (size_t i = 0; i < N * r; i++)
        a->h[i] *= l->scale;
    ops_gemm(0, 1, N, out, r, a->h, r, l->b[j], r, 1.0f, y, out);
}

/* The base linear's input gradient, d_inp (N,in) = dy W, then the adapter's share of it and
 * its gradients. */
static void linear_backward(const struct gpt_config *cfg, const struct gpt_lora_params *l,
                            struct gpt_lora_grads *g, int j, float *d_inp, const float *dy,
                            const float *x, const float *W, size_t N, struct lora_acts *a)
{
    size_t out, in, r = (size_t)l->r;
    gpt_lora_dims(cfg, j, &out, &in);
    ops_gemm(0, 0, N, in, out, dy, out, W, in, 0.0f, d_inp, in);
    if (!l->a[j]) return;
    ops_gemm(0, 1, N, r, in, x, in, l->a[j], in, 0.0f, a->h, r);
    for (size_t i = 0; i < N * r; i++)
        a->h[i] *= l->scale;
    ops_gemm(1, 0, out, r, N, dy, out, a->h, r, 1.0f, g->b[j], r);
    ops_gemm(0, 0, N, r, out, dy, out, l->b[j], r, 0.0f, a->dh, r);
    for (size_t i = 0; i < N * r; i++)
        a->dh[i] *= l->scale;
    ops_gemm(1, 0, r, in, N, a->dh, r, x, in, 1.0f, g->a[j], in);
    ops_gemm(0, 0, N, in, r, a->dh, r, l->a[j], in, 1.0f, d_inp, in);
}

/* The block's internals into a; x_out NULL: up to the MLP's GELU (what the backward needs). */
static void forward_acts(const struct gpt_config *cfg, size_t B, size_t T,
                         const struct gpt_block_params *p, const struct gpt_lora_params *l,
                         const float *x_in, float *x_out, struct lora_acts *a)
{
    size_t N = B * T, C = (size_t)cfg->C;
    const float *const *t = p->t;
    ops_layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x_in, t[GPT_LN1_W], t[GPT_LN1_B], N, C);
    ops_linear_forward(a->qkv, a->ln1, t[GPT_QKV_W], t[GPT_QKV_B], NULL, N, C, 3 * C);
    adapter_forward(cfg, l, GPT_LORA_QKV, a->qkv, a->ln1, N, a);
    ops_attention_forward(a->atty, a->att, a->qkv, B, T, C, (size_t)cfg->NH);
    ops_linear_forward(a->x2, a->atty, t[GPT_ATTN_PROJ_W], t[GPT_ATTN_PROJ_B], x_in, N, C, C);
    adapter_forward(cfg, l, GPT_LORA_ATTN_PROJ, a->x2, a->atty, N, a);
    ops_layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->x2, t[GPT_LN2_W], t[GPT_LN2_B], N, C);
    ops_linear_forward(a->fch, a->ln2, t[GPT_FC_W], t[GPT_FC_B], NULL, N, C, 4 * C);
    adapter_forward(cfg, l, GPT_LORA_FC, a->fch, a->ln2, N, a);
    ops_gelu_forward(a->fch_gelu, a->fch, N * 4 * C);
    if (!x_out) return;
    ops_linear_forward(x_out, a->fch_gelu, t[GPT_MLP_PROJ_W], t[GPT_MLP_PROJ_B], a->x2, N, 4 * C, C);
    adapter_forward(cfg, l, GPT_LORA_MLP_PROJ, x_out, a->fch_gelu, N, a);
}

int gpt_lora_block_forward(const struct gpt_config *cfg, int B, int T,
                           const struct gpt_block_params *p, const struct gpt_lora_params *l,
                           const float *x_in, float *x_out, struct gpt_scratch *s)
{
    struct lora_acts a;
    int r = check(cfg, B, T, p, l, s, &a);
    if (r < 0) return r;
    if (!x_in || !x_out) return -EINVAL;
    forward_acts(cfg, (size_t)B, (size_t)T, p, l, x_in, x_out, &a);
    return 0;
}

int gpt_lora_block_backward(const struct gpt_config *cfg, int B, int T,
                            const struct gpt_block_params *p, const struct gpt_lora_params *l,
                            const float *x_in, const float *d_out, float *d_in,
                            struct gpt_lora_grads *g, struct gpt_scratch *s)
{
    struct lora_acts a;
    int r = check(cfg, B, T, p, l, s, &a);
    if (r < 0) return r;
    if (!x_in || !d_out || !d_in || d_in == x_in || !g) return -EINVAL;
    for (int j = 0; j < GPT_LORA_NTARGETS; j++)
        if (l->a[j] && (!g->a[j] || !g->b[j])) return -EINVAL;
    size_t N = (size_t)B * T, C = (size_t)cfg->C;
    const float *const *t = p->t;
    forward_acts(cfg, (size_t)B, (size_t)T, p, l, x_in, NULL, &a);
    memset(a.dln, 0, 2 * C * sizeof(float)); /* accumulated into, never read */
    /* The MLP half, as gpt.c's: the residual carries d_out to the middle of the block. */
    memcpy(a.d_x2, d_out, N * C * sizeof(float));
    linear_backward(cfg, l, g, GPT_LORA_MLP_PROJ, a.d_big, d_out, a.fch_gelu, t[GPT_MLP_PROJ_W], N,
                    &a);
    ops_gelu_backward(a.d_big, a.fch, N * 4 * C);
    linear_backward(cfg, l, g, GPT_LORA_FC, a.d_small, a.d_big, a.ln2, t[GPT_FC_W], N, &a);
    ops_layernorm_backward(a.d_x2, 1, a.dln, a.dln + C, a.d_small, a.x2, t[GPT_LN2_W], a.ln2_mean,
                           a.ln2_rstd, N, C);
    /* The attention half. */
    linear_backward(cfg, l, g, GPT_LORA_ATTN_PROJ, a.d_small, a.d_x2, a.atty, t[GPT_ATTN_PROJ_W], N,
                    &a);
    ops_attention_backward(a.d_big, a.d_row, a.d_small, a.qkv, a.att, (size_t)B, (size_t)T, C,
                           (size_t)cfg->NH);
    linear_backward(cfg, l, g, GPT_LORA_QKV, a.d_small, a.d_big, a.ln1, t[GPT_QKV_W], N, &a);
    memcpy(d_in, a.d_x2, N * C * sizeof(float));
    ops_layernorm_backward(d_in, 1, a.dln, a.dln + C, a.d_small, x_in, t[GPT_LN1_W], a.ln1_mean,
                           a.ln1_rstd, N, C);
    return 0;
}
