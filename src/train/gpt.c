/*
 * gpt.c - the CPU reference of gpt.h: embedding, transformer block, head and loss, each
 * forward and backward, in fp32.
 *
 * The layers themselves are in ops.c (shared with the tests of the CUDA kernels, which
 * are their twins); this file puts them together, carves the scratch and checks input.
 *
 * A block's forward writes its internals (struct block_acts) into scratch. The public
 * backward recomputes them from the block's input and then runs the backward from them;
 * gpt_model_backward() instead keeps one struct block_acts per block from its forward. Both
 * run the same two functions, so recompute and keep-everything agree exactly.
 *
 * Not here: where parameters live, the optimizer, any GPU code, mixed precision.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/gpt.h"
#include "train/ops.h"

#define ALIGN_FLOATS 16 /* sub-buffers of scratch start on 64-byte boundaries */
#define SCRATCH_ALIGN_BYTES 64
#define MAX_DIM (1 << 20) /* any one dimension; keeps every product well inside size_t */

/* ---- config, layout, init ------------------------------------------------------------- */

void gpt_config_defaults(struct gpt_config *cfg)
{
    *cfg = (struct gpt_config){.V = 256, .maxT = 1024, .L = 12, .C = 768, .NH = 12};
}

int gpt_config_validate(const struct gpt_config *cfg, char *msg, size_t msg_len)
{
    char tmp[128];
    if (!msg || !msg_len) {
        msg = tmp;
        msg_len = sizeof(tmp);
    }
    if (!cfg) {
        snprintf(msg, msg_len, "no config");
        return -EINVAL;
    }
    const struct {
        const char *name;
        int v, max;
    } dims[] = {{"V", cfg->V, MAX_DIM},
                {"maxT", cfg->maxT, MAX_DIM},
                {"L", cfg->L, 1 << 16},
                {"C", cfg->C, 1 << 16},
                {"NH", cfg->NH, 1 << 16}};
    for (size_t i = 0; i < sizeof(dims) / sizeof(dims[0]); i++) {
        if (dims[i].v < 1 || dims[i].v > dims[i].max) {
            snprintf(msg, msg_len, "%s=%d is out of range: it must be in [1, %d]", dims[i].name,
                     dims[i].v, dims[i].max);
            return -EINVAL;
        }
    }
    if (cfg->C % cfg->NH != 0) {
        snprintf(msg, msg_len,
                 "C=%d is not a multiple of NH=%d: every head needs the same size C/NH", cfg->C,
                 cfg->NH);
        return -EINVAL;
    }
    msg[0] = '\0';
    return 0;
}

static const char *const slot_names[GPT_BLOCK_NSLOTS] = {
    [GPT_LN1_W] = "ln1.w",
    [GPT_LN1_B] = "ln1.b",
    [GPT_QKV_W] = "attn.qkv.w",
    [GPT_QKV_B] = "attn.qkv.b",
    [GPT_ATTN_PROJ_W] = "attn.proj.w",
    [GPT_ATTN_PROJ_B] = "attn.proj.b",
    [GPT_LN2_W] = "ln2.w",
    [GPT_LN2_B] = "ln2.b",
    [GPT_FC_W] = "mlp.fc.w",
    [GPT_FC_B] = "mlp.fc.b",
    [GPT_MLP_PROJ_W] = "mlp.proj.w",
    [GPT_MLP_PROJ_B] = "mlp.proj.b",
};

const char *gpt_block_slot_name(int slot)
{
    return slot >= 0 && slot < GPT_BLOCK_NSLOTS ? slot_names[slot] : NULL;
}

/* (rows, cols) of a block slot; cols is 1 for vectors. */
static void slot_shape(size_t C, int slot, size_t *rows, size_t *cols)
{
    static const unsigned char r[GPT_BLOCK_NSLOTS] = {1, 1, 3, 3, 1, 1, 1, 1, 4, 4, 1, 1};
    static const unsigned char c[GPT_BLOCK_NSLOTS] = {0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 0};
    *rows = r[slot] * C;
    *cols = c[slot] ? c[slot] * C : 1;
}

size_t gpt_block_num_params(const struct gpt_config *cfg)
{
    size_t C = (size_t)cfg->C;
    return 12 * C * C + 13 * C; /* weights 3CC + CC + 4CC + 4CC; vectors 2C+3C+C+2C+4C+C */
}

size_t gpt_num_params(const struct gpt_config *cfg)
{
    size_t C = (size_t)cfg->C;
    return ((size_t)cfg->V + (size_t)cfg->maxT) * C + (size_t)cfg->L * gpt_block_num_params(cfg) +
           2 * C;
}

int gpt_layout(const struct gpt_config *cfg, struct gpt_tensor_desc *out, size_t cap)
{
    int r = gpt_config_validate(cfg, NULL, 0);
    if (r < 0) return r;
    if (!out && cap) return -EINVAL;
    size_t C = (size_t)cfg->C, count = 4 + (size_t)GPT_BLOCK_NSLOTS * (size_t)cfg->L;
    size_t off = 0, i = 0;
    struct gpt_tensor_desc d;

#define EMIT()                                                                                     \
    do {                                                                                           \
        d.numel = d.shape[0] * d.shape[1];                                                         \
        d.offset = off;                                                                            \
        off += d.numel;                                                                            \
        if (i < cap) out[i] = d;                                                                   \
        i++;                                                                                       \
    } while (0)

    d = (struct gpt_tensor_desc){
        .name = "wte", .block = -1, .slot = GPT_WTE, .ndim = 2, .shape = {(size_t)cfg->V, C}};
    EMIT();
    d = (struct gpt_tensor_desc){
        .name = "wpe", .block = -1, .slot = GPT_WPE, .ndim = 2, .shape = {(size_t)cfg->maxT, C}};
    EMIT();
    for (int l = 0; l < cfg->L; l++) {
        for (int s = 0; s < GPT_BLOCK_NSLOTS; s++) {
            memset(&d, 0, sizeof(d));
            snprintf(d.name, sizeof(d.name), "h%d.%s", l, slot_names[s]);
            d.block = l;
            d.slot = s;
            slot_shape(C, s, &d.shape[0], &d.shape[1]);
            d.ndim = d.shape[1] == 1 ? 1 : 2;
            EMIT();
        }
    }
    d = (struct gpt_tensor_desc){
        .name = "lnf.w", .block = -1, .slot = GPT_LNF_W, .ndim = 1, .shape = {C, 1}};
    EMIT();
    d = (struct gpt_tensor_desc){
        .name = "lnf.b", .block = -1, .slot = GPT_LNF_B, .ndim = 1, .shape = {C, 1}};
    EMIT();
#undef EMIT
    return (int)count;
}

static void block_pointers(size_t C, const float *block, const float *t[GPT_BLOCK_NSLOTS])
{
    size_t off = 0;
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++) {
        size_t rows, cols;
        slot_shape(C, s, &rows, &cols);
        t[s] = block + off;
        off += rows * cols;
    }
}

void gpt_block_params_at(const struct gpt_config *cfg, const float *block,
                         struct gpt_block_params *p)
{
    block_pointers((size_t)cfg->C, block, p->t);
}

void gpt_block_grads_at(const struct gpt_config *cfg, float *block, struct gpt_block_grads *g)
{
    const float *t[GPT_BLOCK_NSLOTS];
    block_pointers((size_t)cfg->C, block, t);
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++)
        g->t[s] = block + (t[s] - block);
}

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1]: never 0, so log() below stays finite. */
static double uniform01(uint64_t *state)
{
    return ((splitmix64(state) >> 11) + 1) * (1.0 / 9007199254740992.0);
}

int gpt_init_tensor(const struct gpt_config *cfg, const struct gpt_tensor_desc *d, float *data,
                    uint64_t seed)
{
    int r = gpt_config_validate(cfg, NULL, 0);
    if (r < 0) return r;
    if (!d || (!data && d->numel)) return -EINVAL;
    int is_vector = d->ndim == 1;
    int is_ln_w = (d->block < 0 && d->slot == GPT_LNF_W) ||
                  (d->block >= 0 && (d->slot == GPT_LN1_W || d->slot == GPT_LN2_W));
    if (is_ln_w) {
        for (size_t i = 0; i < d->numel; i++)
            data[i] = 1.0f;
        return 0;
    }
    if (is_vector) { /* biases and LayerNorm biases */
        memset(data, 0, d->numel * sizeof(float));
        return 0;
    }
    double std = 0.02;
    if (d->block >= 0 && (d->slot == GPT_ATTN_PROJ_W || d->slot == GPT_MLP_PROJ_W))
        std /= sqrt(2.0 * cfg->L);
    /* The stream depends on the seed and the name only (FNV-1a of the name). */
    uint64_t state = seed ^ 0xcbf29ce484222325ull;
    for (const char *c = d->name; *c; c++)
        state = (state ^ (unsigned char)*c) * 0x100000001b3ull;
    /* splitmix64 steps its state by a constant, so pair p's uniforms are the stream's draws
     * 2p and 2p + 1 wherever a thread starts: the pairs are spread over the threads with the
     * values of one sequential pass. */
    size_t pairs = (d->numel + 1) / 2;
#pragma omp parallel for schedule(static) if (pairs >= (1u << 14))
    for (size_t p = 0; p < pairs; p++) {
        uint64_t st = state + 2 * (uint64_t)p * 0x9e3779b97f4a7c15ull;
        /* Box-Muller: two normals per pair of uniforms. */
        double u1 = uniform01(&st), u2 = uniform01(&st);
        double rad = sqrt(-2.0 * log(u1)), ang = 2.0 * M_PI * u2;
        size_t i = 2 * p;
        data[i] = (float)(std * rad * cos(ang));
        if (i + 1 < d->numel) data[i + 1] = (float)(std * rad * sin(ang));
    }
    return 0;
}

/* ---- scratch ----------------------------------------------------------------------------- */

struct dims {
    size_t B, T, C, NH, V, N; /* N = B*T rows */
};

static struct dims dims_of(const struct gpt_config *cfg, int B, int T)
{
    return (struct dims){.B = (size_t)B,
                         .T = (size_t)T,
                         .C = (size_t)cfg->C,
                         .NH = (size_t)cfg->NH,
                         .V = (size_t)cfg->V,
                         .N = (size_t)B * T};
}

/* The next n floats at *off from base (NULL while only sizing), rounded up so every
 * sub-buffer starts 64-byte aligned. */
static float *take(float *base, size_t *off, size_t n)
{
    float *p = base ? base + *off : NULL;
    *off += (n + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
    return p;
}

/* One block's internals, written by its forward and read by its backward. */
struct block_acts {
    float *ln1, *ln1_mean, *ln1_rstd; /* (B,T,C), (B,T), (B,T) */
    float *qkv;                       /* (B,T,3C) */
    float *att;                       /* (B,NH,T,T) softmax probabilities */
    float *atty;                      /* (B,T,C) attention output before its projection */
    float *x2;                        /* (B,T,C) residual stream after the attention */
    float *ln2, *ln2_mean, *ln2_rstd; /* (B,T,C), (B,T), (B,T) */
    float *fch;                       /* (B,T,4C) before the GELU */
    float *fch_gelu;                  /* (B,T,4C) */
};

/* The gradients of a block's internals. Buffers are reused once what they held is dead:
 *   d_big   (B,T,4C): dloss/dfch_gelu, then dloss/dfch in place, then dloss/dqkv (B,T,3C);
 *   d_small (B,T,C):  dloss/dln2, then dloss/datty, then dloss/dln1. */
struct block_dacts {
    float *d_x2;    /* (B,T,C) */
    float *d_big;   /* (B,T,4C) */
    float *d_small; /* (B,T,C) */
    float *d_row;   /* (B,NH,T) */
};

/* The head's internals: final LayerNorm and logits. */
struct head_acts {
    float *lnf, *mean, *rstd; /* (B,T,C), (B,T), (B,T) */
    float *logits;            /* (B,T,V); turned into dloss/dlogits in place by the backward */
    float *losses;            /* (B,T) per-position loss, summed in a fixed order */
    float *d_lnf;             /* (B,T,C) */
};

static void carve_acts(struct block_acts *a, float *base, size_t *off, const struct dims *d)
{
    size_t NC = d->N * d->C;
    a->ln1 = take(base, off, NC);
    a->ln1_mean = take(base, off, d->N);
    a->ln1_rstd = take(base, off, d->N);
    a->qkv = take(base, off, 3 * NC);
    a->att = take(base, off, d->B * d->NH * d->T * d->T);
    a->atty = take(base, off, NC);
    a->x2 = take(base, off, NC);
    a->ln2 = take(base, off, NC);
    a->ln2_mean = take(base, off, d->N);
    a->ln2_rstd = take(base, off, d->N);
    a->fch = take(base, off, 4 * NC);
    a->fch_gelu = take(base, off, 4 * NC);
}

static void carve_dacts(struct block_dacts *a, float *base, size_t *off, const struct dims *d)
{
    size_t NC = d->N * d->C;
    a->d_x2 = take(base, off, NC);
    a->d_big = take(base, off, 4 * NC);
    a->d_small = take(base, off, NC);
    a->d_row = take(base, off, d->B * d->NH * d->T);
}

static void carve_head(struct head_acts *h, float *base, size_t *off, const struct dims *d)
{
    h->lnf = take(base, off, d->N * d->C);
    h->mean = take(base, off, d->N);
    h->rstd = take(base, off, d->N);
    h->logits = take(base, off, d->N * d->V);
    h->losses = take(base, off, d->N);
    h->d_lnf = take(base, off, d->N * d->C);
}

/* Floats of scratch: a block's acts and dacts, or the head's, whichever is larger. */
static size_t scratch_floats(const struct dims *d)
{
    struct block_acts a;
    struct block_dacts da;
    struct head_acts h;
    size_t block = 0, head = 0;
    carve_acts(&a, NULL, &block, d);
    carve_dacts(&da, NULL, &block, d);
    carve_head(&h, NULL, &head, d);
    return block > head ? block : head;
}

/* 0 when (cfg, B, T) can be run, else -EINVAL. */
static int check_bt(const struct gpt_config *cfg, int B, int T)
{
    int r = gpt_config_validate(cfg, NULL, 0);
    if (r < 0) return r;
    /* B*T rows and the widest GEMM dimension go to BLAS as int. */
    if (B < 1 || T < 1 || T > cfg->maxT || (long long)B * T > INT_MAX / 4) return -EINVAL;
    return 0;
}

size_t gpt_scratch_bytes(const struct gpt_config *cfg, int B, int T)
{
    if (check_bt(cfg, B, T) < 0) return 0;
    struct dims d = dims_of(cfg, B, T);
    return scratch_floats(&d) * sizeof(float) + SCRATCH_ALIGN_BYTES;
}

/* The 64-byte aligned start of s, or NULL when s is missing or too small. */
static float *scratch_base(const struct dims *d, struct gpt_scratch *s)
{
    if (!s || !s->mem) return NULL;
    if (s->bytes < scratch_floats(d) * sizeof(float) + SCRATCH_ALIGN_BYTES) return NULL;
    uintptr_t a =
        ((uintptr_t)s->mem + SCRATCH_ALIGN_BYTES - 1) & ~(uintptr_t)(SCRATCH_ALIGN_BYTES - 1);
    return (float *)a;
}

static int check_tokens(const int *tok, size_t N, int V)
{
    if (!tok) return -EINVAL;
    for (size_t i = 0; i < N; i++)
        if (tok[i] < 0 || tok[i] >= V) return -EINVAL;
    return 0;
}

static int check_block_params(const struct gpt_block_params *p)
{
    if (!p) return -EINVAL;
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++)
        if (!p->t[s]) return -EINVAL;
    return 0;
}

/* The slots [lo, hi) of one half are all given. */
static int check_half(const float *const *t, int lo, int hi)
{
    for (int i = lo; i < hi; i++)
        if (!t[i]) return -EINVAL;
    return 0;
}

static int check_block_grads(const struct gpt_block_grads *g)
{
    if (!g) return -EINVAL;
    for (int s = 0; s < GPT_BLOCK_NSLOTS; s++)
        if (!g->t[s]) return -EINVAL;
    return 0;
}

/* ---- the pieces: embedding, block, head ---------------------------------------------------- */

/* x_out (B,T,C) = block(x_in); x_out NULL: fill a up to the last LayerNorm-MLP input only
 * (what the backward needs). x_out may be x_in: x_in is last read before x_out is written. */
/* The attention half, x2 = x_in + attn_proj(attention(qkv(ln1(x_in)))), into a->x2. */
static void attn_forward_acts(const struct dims *d, const struct gpt_block_params *p,
                              const float *x_in, struct block_acts *a)
{
    size_t N = d->N, C = d->C;
    const float *const *t = p->t;
    ops_layernorm_forward(a->ln1, a->ln1_mean, a->ln1_rstd, x_in, t[GPT_LN1_W], t[GPT_LN1_B], N, C);
    ops_linear_forward(a->qkv, a->ln1, t[GPT_QKV_W], t[GPT_QKV_B], NULL, N, C, 3 * C);
    ops_attention_forward(a->atty, a->att, a->qkv, d->B, d->T, C, d->NH);
    ops_linear_forward(a->x2, a->atty, t[GPT_ATTN_PROJ_W], t[GPT_ATTN_PROJ_B], x_in, N, C, C);
}

/* The MLP half from a->x2: x_out = x2 + mlp_proj(gelu(mlp_fc(ln2(x2)))) (x_out NULL: the
 * internals only, for a backward). */
static void mlp_forward_acts(const struct dims *d, const struct gpt_block_params *p,
                             float *x_out, struct block_acts *a)
{
    size_t N = d->N, C = d->C;
    const float *const *t = p->t;
    ops_layernorm_forward(a->ln2, a->ln2_mean, a->ln2_rstd, a->x2, t[GPT_LN2_W], t[GPT_LN2_B], N, C);
    ops_linear_forward(a->fch, a->ln2, t[GPT_FC_W], t[GPT_FC_B], NULL, N, C, 4 * C);
    ops_gelu_forward(a->fch_gelu, a->fch, N * 4 * C);
    if (x_out)
        ops_linear_forward(x_out, a->fch_gelu, t[GPT_MLP_PROJ_W], t[GPT_MLP_PROJ_B], a->x2, N, 4 * C,
                       C);
}

static void block_forward_acts(const struct dims *d, const struct gpt_block_params *p,
                               const float *x_in, float *x_out, struct block_acts *a)
{
    attn_forward_acts(d, p, x_in, a);
    mlp_forward_acts(d, p, x_out, a);
}

/* d_in (B,T,C) = d_out (B,T,C) pulled back through the block whose internals are in a;
 * g += the parameter gradients. d_in may be d_out: d_out is last read (step 2) long before
 * d_in is written (step 9). */
/* The MLP half's backward: da->d_x2 = d_out + ln2's input gradient through the MLP. */
static void mlp_backward_acts(const struct dims *d, const struct gpt_block_params *p,
                              const struct block_acts *a, const struct block_dacts *da,
                              const float *d_out, struct gpt_block_grads *g)
{
    size_t N = d->N, C = d->C;
    const float *const *t = p->t;
    float *const *gt = g->t;
    /* 1. The residual path carries d_out straight to the middle of the block. */
    memcpy(da->d_x2, d_out, N * C * sizeof(float));
    /* 2-4. MLP: projection, GELU, fc. */
    ops_linear_backward(da->d_big, gt[GPT_MLP_PROJ_W], gt[GPT_MLP_PROJ_B], d_out, a->fch_gelu,
                    t[GPT_MLP_PROJ_W], N, 4 * C, C);
    ops_gelu_backward(da->d_big, a->fch, N * 4 * C);
    ops_linear_backward(da->d_small, gt[GPT_FC_W], gt[GPT_FC_B], da->d_big, a->ln2, t[GPT_FC_W], N, C,
                    4 * C);
    /* 5. ln2 adds its input gradient to the residual stream's. */
    ops_layernorm_backward(da->d_x2, 1, gt[GPT_LN2_W], gt[GPT_LN2_B], da->d_small, a->x2, t[GPT_LN2_W],
                       a->ln2_mean, a->ln2_rstd, N, C);
}

/* The attention half's backward from da->d_x2: d_in = d_x2 + ln1's input gradient. */
static void attn_backward_acts(const struct dims *d, const struct gpt_block_params *p,
                               const float *x_in, const struct block_acts *a,
                               const struct block_dacts *da, float *d_in,
                               struct gpt_block_grads *g)
{
    size_t N = d->N, C = d->C;
    const float *const *t = p->t;
    float *const *gt = g->t;
    /* 6-8. Attention: projection, attention itself, qkv. */
    ops_linear_backward(da->d_small, gt[GPT_ATTN_PROJ_W], gt[GPT_ATTN_PROJ_B], da->d_x2, a->atty,
                    t[GPT_ATTN_PROJ_W], N, C, C);
    ops_attention_backward(da->d_big, da->d_row, da->d_small, a->qkv, a->att, d->B, d->T, C, d->NH);
    ops_linear_backward(da->d_small, gt[GPT_QKV_W], gt[GPT_QKV_B], da->d_big, a->ln1, t[GPT_QKV_W], N,
                    C, 3 * C);
    /* 9. d_in = residual path + ln1's input gradient. */
    memcpy(d_in, da->d_x2, N * C * sizeof(float));
    ops_layernorm_backward(d_in, 1, gt[GPT_LN1_W], gt[GPT_LN1_B], da->d_small, x_in, t[GPT_LN1_W],
                       a->ln1_mean, a->ln1_rstd, N, C);
}

/* d_in (B,T,C) = d_out (B,T,C) pulled back through the block whose internals are in a;
 * g += the parameter gradients. d_in may be d_out: d_out is last read (step 2) long before
 * d_in is written (step 9). */
static void block_backward_acts(const struct dims *d, const struct gpt_block_params *p,
                                const float *x_in, const struct block_acts *a,
                                const struct block_dacts *da, const float *d_out, float *d_in,
                                struct gpt_block_grads *g)
{
    mlp_backward_acts(d, p, a, da, d_out, g);
    attn_backward_acts(d, p, x_in, a, da, d_in, g);
}

/* lnf and logits of x (B,T,C) into h. */
static void head_logits(const struct dims *d, const float *lnf_w, const float *lnf_b,
                        const float *wte, const float *x, struct head_acts *h)
{
    ops_layernorm_forward(h->lnf, h->mean, h->rstd, x, lnf_w, lnf_b, d->N, d->C);
    ops_gemm(0, 1, d->N, d->V, d->C, h->lnf, d->C, wte, d->C, 0.0f, h->logits, d->V);
}

/* d_x (B,T,C) may be x: only the last step reads x, and layernorm_backward allows it. */
static float head_backward(const struct dims *d, const float *lnf_w, const float *lnf_b,
                           const float *wte, const float *x, const int *targets, float *d_x,
                           float *d_lnf_w, float *d_lnf_b, float *d_wte, struct head_acts *h)
{
    size_t N = d->N, C = d->C, V = d->V;
    head_logits(d, lnf_w, lnf_b, wte, x, h);
    float loss = ops_crossentropy(h->logits, h->losses, targets, d->N, d->V, 1);
    /* d_lnf (N,C) = dlogits (N,V) @ wte (V,C); d_wte (V,C) += dlogits^T @ lnf (N,C). */
    ops_gemm(0, 0, N, C, V, h->logits, V, wte, C, 0.0f, h->d_lnf, C);
    if (d_wte) ops_gemm(1, 0, V, C, N, h->logits, V, h->lnf, C, 1.0f, d_wte, C);
    ops_layernorm_backward(d_x, 0, d_lnf_w, d_lnf_b, h->d_lnf, x, lnf_w, h->mean, h->rstd, N, C);
    return loss;
}

/* ---- public per-piece API ------------------------------------------------------------------ */

int gpt_embed_forward(const struct gpt_config *cfg, int B, int T, const float *wte,
                      const float *wpe, const int *tokens, float *x)
{
    int r = check_bt(cfg, B, T);
    if (r < 0) return r;
    if (!wte || !wpe || !x) return -EINVAL;
    struct dims d = dims_of(cfg, B, T);
    if ((r = check_tokens(tokens, d.N, cfg->V)) < 0) return r;
    ops_embed_forward(x, wte, wpe, tokens, d.B, d.T, d.C);
    return 0;
}

int gpt_embed_backward(const struct gpt_config *cfg, int B, int T, const int *tokens,
                       const float *d_x, float *d_wte, float *d_wpe)
{
    int r = check_bt(cfg, B, T);
    if (r < 0) return r;
    if (!d_x || !d_wte || !d_wpe) return -EINVAL;
    struct dims d = dims_of(cfg, B, T);
    if ((r = check_tokens(tokens, d.N, cfg->V)) < 0) return r;
    ops_embed_backward(d_wte, d_wpe, d_x, tokens, d.B, d.T, d.C);
    return 0;
}

int gpt_block_forward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                      const float *x_in, float *x_out, struct gpt_scratch *s)
{
    int r = check_bt(cfg, B, T);
    if (r < 0) return r;
    if (check_block_params(p) < 0 || !x_in || !x_out) return -EINVAL;
    struct dims d = dims_of(cfg, B, T);
    float *base = scratch_base(&d, s);
    if (!base) return -EINVAL;
    struct block_acts a;
    size_t off = 0;
    carve_acts(&a, base, &off, &d);
    block_forward_acts(&d, p, x_in, x_out, &a);
    return 0;
}

int gpt_block_backward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                       const float *x_in, const float *d_out, float *d_in,
                       struct gpt_block_grads *g, struct gpt_scratch *s)
{
    int r = check_bt(cfg, B, T);
    if (r < 0) return r;
    if (check_block_params(p) < 0 || check_block_grads(g) < 0 || !x_in || !d_out || !d_in ||
        d_in == x_in)
        return -EINVAL;
    struct dims d = dims_of(cfg, B, T);
    float *base = scratch_base(&d, s);
    if (!base) return -EINVAL;
    struct block_acts a;
    struct block_dacts da;
    size_t off = 0;
    carve_acts(&a, base, &off, &d);
    carve_dacts(&da, base, &off, &d);
    block_forward_acts(&d, p, x_in, NULL, &a);
    block_backward_acts(&d, p, x_in, &a, &da, d_out, d_in, g);
    return 0;
}

/* The two halves: the attention's slots [GPT_LN1_W, GPT_LN2_W), the MLP's the rest. */
static int half_call(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                     const struct gpt_block_grads *g, bool attn, struct gpt_scratch *s,
                     struct dims *d, struct block_acts *a, struct block_dacts *da)
{
    int r = check_bt(cfg, B, T);
    if (r < 0) return r;
    int lo = attn ? GPT_LN1_W : GPT_LN2_W, hi = attn ? GPT_LN2_W : GPT_BLOCK_NSLOTS;
    if (!p || check_half(p->t, lo, hi) < 0 || (g && check_half((const float *const *)g->t, lo, hi) < 0))
        return -EINVAL;
    *d = dims_of(cfg, B, T);
    float *base = scratch_base(d, s);
    if (!base) return -EINVAL;
    size_t off = 0;
    carve_acts(a, base, &off, d);
    carve_dacts(da, base, &off, d);
    return 0;
}

int gpt_attn_forward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                     const float *x_in, float *x2, struct gpt_scratch *s)
{
    struct dims d;
    struct block_acts a;
    struct block_dacts da;
    int r = half_call(cfg, B, T, p, NULL, true, s, &d, &a, &da);
    if (r < 0 || !x_in || !x2) return r < 0 ? r : -EINVAL;
    attn_forward_acts(&d, p, x_in, &a);
    memcpy(x2, a.x2, d.N * d.C * sizeof(float));
    return 0;
}

int gpt_mlp_forward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                    const float *x2, float *x_out, struct gpt_scratch *s)
{
    struct dims d;
    struct block_acts a;
    struct block_dacts da;
    int r = half_call(cfg, B, T, p, NULL, false, s, &d, &a, &da);
    if (r < 0 || !x2 || !x_out) return r < 0 ? r : -EINVAL;
    memcpy(a.x2, x2, d.N * d.C * sizeof(float));
    mlp_forward_acts(&d, p, x_out, &a);
    return 0;
}

int gpt_attn_backward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                      const float *x_in, const float *d_x2, float *d_in, struct gpt_block_grads *g,
                      struct gpt_scratch *s)
{
    struct dims d;
    struct block_acts a;
    struct block_dacts da;
    int r = half_call(cfg, B, T, p, g, true, s, &d, &a, &da);
    if (r < 0 || !g || !x_in || !d_x2 || !d_in || d_in == x_in) return r < 0 ? r : -EINVAL;
    memcpy(da.d_x2, d_x2, d.N * d.C * sizeof(float));
    attn_forward_acts(&d, p, x_in, &a);
    attn_backward_acts(&d, p, x_in, &a, &da, d_in, g);
    return 0;
}

int gpt_mlp_backward(const struct gpt_config *cfg, int B, int T, const struct gpt_block_params *p,
                     const float *x2, const float *d_out, float *d_x2, struct gpt_block_grads *g,
                     struct gpt_scratch *s)
{
    struct dims d;
    struct block_acts a;
    struct block_dacts da;
    int r = half_call(cfg, B, T, p, g, false, s, &d, &a, &da);
    if (r < 0 || !g || !x2 || !d_out || !d_x2 || d_x2 == x2) return r < 0 ? r : -EINVAL;
    memcpy(a.x2, x2, d.N * d.C * sizeof(float));
    mlp_forward_acts(&d, p, NULL, &a);
    mlp_backward_acts(&d, p, &a, &da, d_out, g);
    memcpy(d_x2, da.d_x2, d.N * d.C * sizeof(float));
    return 0;
}

int gpt_head_forward(const struct gpt_config *cfg, int B, int T, const float *lnf_w,
                     const float *lnf_b, const float *wte, const float *x, const int *targets,
                     float *loss, float *logits, struct gpt_scratch *s)
{
    int r = check_bt(cfg, B, T);
    if (r < 0) return r;
    if (!lnf_w || !lnf_b || !wte || !x) return -EINVAL;
    struct dims d = dims_of(cfg, B, T);
    if (loss && (r = check_tokens(targets, d.N, cfg->V)) < 0) return r;
    float *base = scratch_base(&d, s);
    if (!base) return -EINVAL;
    struct head_acts h;
    size_t off = 0;
    carve_head(&h, base, &off, &d);
    head_logits(&d, lnf_w, lnf_b, wte, x, &h);
    if (logits) memcpy(logits, h.logits, d.N * d.V * sizeof(float));
    if (loss) *loss = ops_crossentropy(h.logits, h.losses, targets, d.N, d.V, 0);
    return 0;
}

int gpt_head_backward(const struct gpt_config *cfg, int B, int T, const float *lnf_w,
                      const float *lnf_b, const float *wte, const float *x, const int *targets,
                      float *d_x, float *d_lnf_w, float *d_lnf_b, float *d_wte, float *loss,
                      struct gpt_scratch *s)
{
    int r = check_bt(cfg, B, T);
    if (r < 0) return r;
    if (!lnf_w || !lnf_b || !wte || !x || !d_x || !d_lnf_w || !d_lnf_b) return -EINVAL;
    struct dims d = dims_of(cfg, B, T);
    if ((r = check_tokens(targets, d.N, cfg->V)) < 0) return r;
    float *base = scratch_base(&d, s);
    if (!base) return -EINVAL;
    struct head_acts h;
    size_t off = 0;
    carve_head(&h, base, &off, &d);
    float l = head_backward(&d, lnf_w, lnf_b, wte, x, targets, d_x, d_lnf_w, d_lnf_b, d_wte, &h);
    if (loss) *loss = l;
    return 0;
}

/* ---- whole model over one contiguous buffer --------------------------------------------- */

/* Where each part of the model lives in a contiguous buffer (of parameters or gradients). */
struct model_view {
    float *wte, *wpe, *blocks, *lnf_w, *lnf_b;
    size_t block_floats;
};

static struct model_view model_view(const struct gpt_config *cfg, const float *buf)
{
    struct model_view v;
    size_t C = (size_t)cfg->C;
    v.wte = (float *)buf; /* const again at every use that reads parameters */
    v.wpe = v.wte + (size_t)cfg->V * C;
    v.blocks = v.wpe + (size_t)cfg->maxT * C;
    v.block_floats = gpt_block_num_params(cfg);
    v.lnf_w = v.blocks + (size_t)cfg->L * v.block_floats;
    v.lnf_b = v.lnf_w + C;
    return v;
}

int gpt_model_init(const struct gpt_config *cfg, float *params, uint64_t seed)
{
    int n = gpt_layout(cfg, NULL, 0);
    if (n < 0) return n;
    if (!params) return -EINVAL;
    struct gpt_tensor_desc *desc = malloc((size_t)n * sizeof(*desc));
    if (!desc) return -ENOMEM;
    gpt_layout(cfg, desc, (size_t)n);
    int r = 0;
    for (int i = 0; i < n && r == 0; i++)
        r = gpt_init_tensor(cfg, &desc[i], params + desc[i].offset, seed);
    free(desc);
    return r;
}

static int check_model_call(const struct gpt_config *cfg, int B, int T, const float *params,
                            const int *tokens, const int *targets)
{
    int r = check_bt(cfg, B, T);
    if (r < 0) return r;
    if (!params) return -EINVAL;
    size_t N = (size_t)B * T;
    if ((r = check_tokens(tokens, N, cfg->V)) < 0) return r;
    return check_tokens(targets, N, cfg->V);
}

int gpt_model_forward(const struct gpt_config *cfg, int B, int T, const float *params,
                      const int *tokens, const int *targets, float *loss)
{
    int r = check_model_call(cfg, B, T, params, tokens, targets);
    if (r < 0) return r;
    if (!loss) return -EINVAL;
    struct dims d = dims_of(cfg, B, T);
    struct gpt_scratch s = {.bytes = gpt_scratch_bytes(cfg, B, T)};
    float *x = malloc(d.N * d.C * sizeof(float)); /* (B,T,C), updated in place by each block */
    s.mem = malloc(s.bytes);
    if (!x || !s.mem) {
        r = -ENOMEM;
        goto err;
    }
    struct model_view pv = model_view(cfg, params);
    ops_embed_forward(x, pv.wte, pv.wpe, tokens, d.B, d.T, d.C);
    for (int l = 0; l < cfg->L; l++) {
        struct gpt_block_params bp;
        gpt_block_params_at(cfg, pv.blocks + (size_t)l * pv.block_floats, &bp);
        r = gpt_block_forward(cfg, B, T, &bp, x, x, &s);
        if (r < 0) goto err;
    }
    r = gpt_head_forward(cfg, B, T, pv.lnf_w, pv.lnf_b, pv.wte, x, targets, loss, NULL, &s);
err:
    free(s.mem);
    free(x);
    return r;
}

int gpt_model_backward(const struct gpt_config *cfg, int B, int T, const float *params,
                       const int *tokens, const int *targets, float *grads, float *loss)
{
    int r = check_model_call(cfg, B, T, params, tokens, targets);
    if (r < 0) return r;
    if (!grads) return -EINVAL;
    struct dims d = dims_of(cfg, B, T);
    size_t L = (size_t)cfg->L, NC = d.N * d.C;

    /* One allocation: the L+1 residual-stream states, every block's internals, one set of
     * gradient buffers shared by the blocks, and the head's internals. */
    struct block_acts *acts = malloc(L * sizeof(*acts));
    float *xs = NULL, *mem = NULL;
    size_t floats = 0;
    struct block_dacts da;
    struct head_acts h;
    take(NULL, &floats, (L + 1) * NC);
    for (size_t l = 0; l < L && acts; l++)
        carve_acts(&acts[l], NULL, &floats, &d);
    carve_dacts(&da, NULL, &floats, &d);
    carve_head(&h, NULL, &floats, &d);
    if (acts) mem = malloc(floats * sizeof(float));
    if (!acts || !mem) {
        r = -ENOMEM;
        goto err;
    }
    size_t off = 0;
    xs = take(mem, &off, (L + 1) * NC); /* xs + l*NC is block l's input (B,T,C) */
    for (size_t l = 0; l < L; l++)
        carve_acts(&acts[l], mem, &off, &d);
    carve_dacts(&da, mem, &off, &d);
    carve_head(&h, mem, &off, &d);

    struct model_view pv = model_view(cfg, params), gv = model_view(cfg, grads);
    ops_embed_forward(xs, pv.wte, pv.wpe, tokens, d.B, d.T, d.C);
    for (size_t l = 0; l < L; l++) {
        struct gpt_block_params bp;
        gpt_block_params_at(cfg, pv.blocks + l * pv.block_floats, &bp);
        block_forward_acts(&d, &bp, xs + l * NC, xs + (l + 1) * NC, &acts[l]);
    }
    /* The gradient of the residual stream replaces the last state in place. */
    float *dx = xs + L * NC;
    float lv = head_backward(&d, pv.lnf_w, pv.lnf_b, pv.wte, dx, targets, dx, gv.lnf_w, gv.lnf_b,
                             gv.wte, &h);
    for (size_t l = L; l-- > 0;) {
        struct gpt_block_params bp;
        struct gpt_block_grads bg;
        gpt_block_params_at(cfg, pv.blocks + l * pv.block_floats, &bp);
        gpt_block_grads_at(cfg, gv.blocks + l * gv.block_floats, &bg);
        block_backward_acts(&d, &bp, xs + l * NC, &acts[l], &da, dx, dx, &bg);
    }
    ops_embed_backward(gv.wte, gv.wpe, dx, tokens, d.B, d.T, d.C);
    if (loss) *loss = lv;
    r = 0;
err:
    free(mem);
    free(acts);
    return r;
}
