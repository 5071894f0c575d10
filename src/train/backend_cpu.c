/*
 * backend_cpu.c - the trainer's math on the CPU (see backend.h): gpt.c's block, head and
 * embedding functions over the host-memory pointers the emulated device tier hands out.
 * Work runs when it is called, so sync has nothing to wait for.
 *
 * With bf16 weights the tensors the device tier holds are bf16; each is widened to fp32
 * into the backend's buffers before use, so the arithmetic is the fp32 reference's on the
 * bf16-rounded weights: the data path of mixed precision (bf16 copies refreshed by the
 * optimizer, carried by the engine) runs and is tested on machines without a GPU.
 *
 * Not here: bf16 activations (adt is always fp32 here), any GPU code.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "train/backend.h"
#include "train/backend_moe.h"
#include "train/digest.h"
#include "train/gpt_lora.h"
#include "train/ops.h"

struct cpu_backend {
    struct backend b;
    struct gpt_config cfg;
    int B, T;
    int *tokens, *targets; /* (B,T) */
    float *d;              /* (B,T,C): the gradient flowing back */
    struct gpt_scratch scratch;
    float loss;
    double sumsq;
    /* bf16 only: fp32 widenings of one block's weights and of wte, wpe, lnf.w, lnf.b. */
    float *wblock, *wte, *wpe, *lnfw, *lnfb;
    float *hgrad; /* loss scaling: the head's own parameter gradients, then scaled in */
    /* LoRA: the block's scratch with its adapters (gpt_lora.h), of rank lrank; in 16 bits,
     * the adapters' fp32 widenings (lwide); a frozen head's LayerNorm gradients (hdummy,
     * thrown away). */
    struct gpt_scratch lscratch;
    int lrank;
    float *lwide, *hdummy;
    /* Tensor parallel: the rank's slices (gpt_tp.h) and its group's collectives; Vr the rows
     * of wte it holds (V without). */
    const struct gpt_tp_comm *tp;
    int Vr;
    /* Sequence parallel: the rank's Tl = T / sp positions of each sequence (T is the whole
     * length the math is told); Tl = T without. */
    const struct backend_sp *sp;
    int Tl;
    size_t slot_numel[GPT_BLOCK_NSLOTS];
    struct backend_cpu_view moe; /* what backend_cpu_moe.c's ops use */
};

static struct cpu_backend *cpu(struct backend *b)
{
    return (struct cpu_backend *)b;
}

static void cpu_close(struct backend *b)
{
    struct cpu_backend *c = cpu(b);
    free(c->tokens);
    free(c->targets);
    free(c->d);
    free(c->scratch.mem);
    free(c->wblock);
    free(c->wte);
    free(c->wpe);
    free(c->lnfw);
    free(c->lnfb);
    free(c->hgrad);
    free(c->lscratch.mem);
    free(c->lwide);
    free(c->hdummy);
    free(c->moe.ms.mem);
    free(c);
}

struct backend_cpu_view *backend_cpu_view(struct backend *b)
{
    return &cpu(b)->moe;
}

static int cpu_set_batch(struct backend *b, const int *tokens, const int *targets)
{
    struct cpu_backend *c = cpu(b);
    /* Sequence parallel: the rank's positions of each sequence. */
    size_t Tl = (size_t)c->Tl, off = c->sp ? (size_t)c->sp->rank * Tl : 0;
    for (size_t r = 0; r < (size_t)c->B; r++) {
        memcpy(c->tokens + r * Tl, tokens + r * (size_t)c->T + off, Tl * sizeof(int));
        memcpy(c->targets + r * Tl, targets + r * (size_t)c->T + off, Tl * sizeof(int));
    }
    return 0;
}

static int cpu_zero(struct backend *b, void *p, size_t bytes)
{
    (void)b;
    memset(p, 0, bytes);
    return 0;
}

/* The fp32 view of a weight: itself, or its widening into buf. */
static void widen_into(struct cpu_backend *c, float *dst, const void *w, size_t n)
{
    if (c->b.wdt == BACKEND_F16)
        ops_cast_f16_to_f32(dst, w, n);
    else
        ops_cast_bf16_to_f32(dst, w, n);
}

static const float *widen(struct cpu_backend *c, const void *w, float *buf, size_t n)
{
    if (c->b.wdt == BACKEND_F32) return w;
    widen_into(c, buf, w, n);
    return buf;
}

static void block_view(struct cpu_backend *c, const void *const *w, struct gpt_block_params *p)
{
    if (c->b.wdt == BACKEND_F32) {
        for (int i = 0; i < GPT_BLOCK_NSLOTS; i++)
            p->t[i] = w[i];
        return;
    }
    if (c->tp)
        gpt_tp_block_params_at(&c->cfg, c->tp->tp, c->tp->rank, c->wblock, p);
    else
        gpt_block_params_at(&c->cfg, c->wblock, p);
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++)
        widen_into(c, (float *)p->t[i], w[i], c->slot_numel[i]);
}

static int cpu_embed_forward(struct backend *b, const void *wte, const void *wpe, void *x)
{
    struct cpu_backend *c = cpu(b);
    size_t C = (size_t)c->cfg.C;
    const float *we = widen(c, wte, c->wte, (size_t)c->Vr * C),
                *wp = widen(c, wpe, c->wpe, (size_t)c->T * C);
    if (c->tp) return gpt_tp_embed_forward(&c->cfg, c->tp, c->B, c->T, we, wp, c->tokens, x);
    if (c->sp)
        return gpt_sp_embed_forward(&c->cfg, c->sp->sp, c->sp->rank, c->B, c->T, we, wp,
                                    c->tokens, x);
    return gpt_embed_forward(&c->cfg, c->B, c->T, we, wp, c->tokens, x);
}

static int cpu_block_forward(struct backend *b, const void *const *w, const void *x_in, void *x_out)
{
    struct cpu_backend *c = cpu(b);
    struct gpt_block_params p;
    block_view(c, w, &p);
    if (c->tp) return gpt_tp_block_forward(&c->cfg, c->tp, c->B, c->T, &p, x_in, x_out, &c->scratch);
    if (c->sp)
        return gpt_sp_block_forward(&c->cfg, c->sp->sp, c->sp->rank, c->B, c->T, &p, x_in, x_out,
                                    &c->scratch, c->sp->alltoall, c->sp->ctx);
    return gpt_block_forward(&c->cfg, c->B, c->T, &p, x_in, x_out, &c->scratch);
}

static int head_backward(struct cpu_backend *c, const float *lw, const float *lb,
                         const float *we, const void *x, float *d_lnf_w, float *d_lnf_b,
                         float *d_wte)
{
    if (c->tp)
        return gpt_tp_head_backward(&c->cfg, c->tp, c->B, c->T, lw, lb, we, x, c->targets, c->d,
                                    d_lnf_w, d_lnf_b, d_wte, &c->loss, &c->scratch);
    if (c->sp)
        return gpt_sp_head_backward(&c->cfg, c->sp->sp, c->sp->rank, c->B, c->T, lw, lb, we, x,
                                    c->targets, c->d, d_lnf_w, d_lnf_b, d_wte, &c->loss,
                                    &c->scratch);
    return gpt_head_backward(&c->cfg, c->B, c->T, lw, lb, we, x, c->targets, c->d, d_lnf_w,
                             d_lnf_b, d_wte, &c->loss, &c->scratch);
}

static int cpu_head_backward(struct backend *b, const void *lnf_w, const void *lnf_b,
                             const void *wte, const void *x, float *d_lnf_w, float *d_lnf_b,
                             float *d_wte)
{
    struct cpu_backend *c = cpu(b);
    size_t C = (size_t)c->cfg.C, VC = (size_t)c->Vr * C;
    float S = c->b.loss_scale;
    const float *lw = widen(c, lnf_w, c->lnfw, C), *lb = widen(c, lnf_b, c->lnfb, C),
                *we = widen(c, wte, c->wte, VC);
    if (!d_lnf_w && !d_lnf_b && !d_wte) { /* a frozen head: the gradient d only */
        if (c->tp || c->sp) return -EOPNOTSUPP;
        if (!c->hdummy && !(c->hdummy = malloc(2 * C * sizeof(float)))) return -ENOMEM;
        int r = gpt_head_backward(&c->cfg, c->B, c->T, lw, lb, we, x, c->targets, c->d, c->hdummy,
                                  c->hdummy + C, NULL, &c->loss, &c->scratch);
        for (size_t i = 0, N = (size_t)c->B * c->Tl * C; r == 0 && S != 1.0f && i < N; i++)
            c->d[i] *= S;
        return r;
    }
    if (!d_lnf_w || !d_lnf_b || !d_wte) return -EINVAL;
    if (S == 1.0f)
        return head_backward(c, lw, lb, we, x, d_lnf_w, d_lnf_b, d_wte);
    /* Loss scaling: the head's share of the parameter gradients and the gradient it hands
     * on, times S (what the accumulated gradients held before stays as it was). */
    if (!c->hgrad && !(c->hgrad = malloc((2 * C + VC) * sizeof(float)))) return -ENOMEM;
    memset(c->hgrad, 0, (2 * C + VC) * sizeof(float));
    int r = head_backward(c, lw, lb, we, x, c->hgrad, c->hgrad + C, c->hgrad + 2 * C);
    if (r < 0) return r;
    for (size_t i = 0; i < C; i++) {
        d_lnf_w[i] += S * c->hgrad[i];
        d_lnf_b[i] += S * c->hgrad[C + i];
    }
    for (size_t i = 0; i < VC; i++)
        d_wte[i] += S * c->hgrad[2 * C + i];
    size_t N = (size_t)c->B * c->Tl * C;
    for (size_t i = 0; i < N; i++)
        c->d[i] *= S;
    return 0;
}

static int cpu_block_backward(struct backend *b, const void *const *w, const void *x_in,
                              float *const *g)
{
    struct cpu_backend *c = cpu(b);
    struct gpt_block_params p;
    struct gpt_block_grads gr;
    block_view(c, w, &p);
    for (int i = 0; i < GPT_BLOCK_NSLOTS; i++)
        gr.t[i] = g[i];
    if (c->tp)
        return gpt_tp_block_backward(&c->cfg, c->tp, c->B, c->T, &p, x_in, c->d, c->d, &gr,
                                     &c->scratch);
    if (c->sp)
        return gpt_sp_block_backward(&c->cfg, c->sp->sp, c->sp->rank, c->B, c->T, &p, x_in, c->d,
                                     c->d, &gr, &c->scratch, c->sp->alltoall, c->sp->ctx);
    return gpt_block_backward(&c->cfg, c->B, c->T, &p, x_in, c->d, c->d, &gr, &c->scratch);
}

/* The fp32 view of one block's adapters (lp), and the scratch of the LoRA block for rank r. */
static int lora_view(struct cpu_backend *c, const void *const *aw, int r, float scale,
                     struct gpt_lora_params *lp)
{
    size_t C = (size_t)c->cfg.C;
    if (c->tp || c->sp) return -EOPNOTSUPP;
    if (c->lrank != r) {
        size_t bytes = gpt_lora_scratch_bytes(&c->cfg, c->B, c->T, r);
        void *mem = bytes ? realloc(c->lscratch.mem, bytes) : NULL;
        float *wide = c->b.wdt == BACKEND_F32
                          ? NULL
                          : realloc(c->lwide, (size_t)r * 16 * C * sizeof(float));
        if (mem) c->lscratch = (struct gpt_scratch){.mem = mem, .bytes = bytes};
        if (wide) c->lwide = wide;
        if (!mem || (c->b.wdt != BACKEND_F32 && !wide)) return -ENOMEM;
        c->lrank = r;
    }
    *lp = (struct gpt_lora_params){.r = r, .scale = scale};
    /* In 16 bits: A (r,in) and B (out,r) of target j widened one after the other; the four
     * targets' in + out add up to 16 C (4 C, 2 C, 5 C, 5 C). */
    float *at = c->lwide;
    for (int j = 0; j < GPT_LORA_NTARGETS; j++) {
        if (!aw[2 * j]) continue;
        size_t out, in;
        gpt_lora_dims(&c->cfg, j, &out, &in);
        lp->a[j] = widen(c, aw[2 * j], at, (size_t)r * in);
        if (at) at += (size_t)r * in;
        lp->b[j] = widen(c, aw[2 * j + 1], at, out * (size_t)r);
        if (at) at += out * (size_t)r;
    }
    return 0;
}

static int cpu_lora_block_forward(struct backend *b, const void *const *w, const void *const *aw,
                                  int r, float scale, const void *x_in, void *x_out)
{
    struct cpu_backend *c = cpu(b);
    struct gpt_block_params p;
    struct gpt_lora_params lp;
    int x = lora_view(c, aw, r, scale, &lp);
    if (x < 0) return x;
    block_view(c, w, &p);
    return gpt_lora_block_forward(&c->cfg, c->B, c->T, &p, &lp, x_in, x_out, &c->lscratch);
}

static int cpu_lora_block_backward(struct backend *b, const void *const *w, const void *const *aw,
                                   int r, float scale, const void *x_in, float *const *ag)
{
    struct cpu_backend *c = cpu(b);
    struct gpt_block_params p;
    struct gpt_lora_params lp;
    struct gpt_lora_grads lg;
    int x = lora_view(c, aw, r, scale, &lp);
    if (x < 0) return x;
    block_view(c, w, &p);
    for (int j = 0; j < GPT_LORA_NTARGETS; j++) {
        lg.a[j] = ag[2 * j];
        lg.b[j] = ag[2 * j + 1];
    }
    return gpt_lora_block_backward(&c->cfg, c->B, c->T, &p, &lp, x_in, c->d, c->d, &lg,
                                   &c->lscratch);
}

static int cpu_embed_backward(struct backend *b, float *d_wte, float *d_wpe)
{
    struct cpu_backend *c = cpu(b);
    if (c->tp)
        return gpt_tp_embed_backward(&c->cfg, c->tp, c->B, c->T, c->tokens, c->d, d_wte, d_wpe);
    if (c->sp)
        return gpt_sp_embed_backward(&c->cfg, c->sp->sp, c->sp->rank, c->B, c->T, c->tokens,
                                     c->d, d_wte, d_wpe);
    return gpt_embed_backward(&c->cfg, c->B, c->T, c->tokens, c->d, d_wte, d_wpe);
}

static int cpu_sumsq(struct backend *b, const float *g, size_t n)
{
    double s;
    int r = adamw_sum_squares(g, n, &s);
    if (r == 0) cpu(b)->sumsq += s;
    return r;
}

static int cpu_adamw(struct backend *b, float *p, const float *g, float *m, float *v,
                     uint16_t *w_bf16, size_t n, const struct adamw_hparams *h, int step,
                     float grad_scale)
{
    if (w_bf16 && b->wdt == BACKEND_F16) {
        /* The fp16 copy: the update, then the cast (no fused kernel for it). */
        int r = adamw_update(p, g, m, v, n, h, step, grad_scale);
        if (r == 0) ops_cast_f32_to_f16(w_bf16, p, n);
        return r;
    }
    if (w_bf16) return adamw_update_bf16(p, g, m, v, w_bf16, n, h, step, grad_scale);
    return adamw_update(p, g, m, v, n, h, step, grad_scale);
}

static int cpu_adamw_states(struct backend *b, float *p, const float *g, void *m, void *v,
                            uint16_t *w16, size_t n, enum adamw_state_dtype dt,
                            const struct adamw_state_at *at, const struct adamw_hparams *h,
                            int step, float grad_scale)
{
    bool f16 = w16 && b->wdt == BACKEND_F16;
    int r = adamw_update_states(dt, p, g, m, v, f16 ? NULL : w16, n, at, h, step, grad_scale);
    if (r == 0 && f16) ops_cast_f32_to_f16(w16, p, n);
    return r;
}

static int cpu_lamb_moments(struct backend *b, const float *p, const float *g, float *m, float *v,
                            size_t n, const struct adamw_hparams *h, float grad_scale,
                            int eps_inside_sqrt, size_t chunk, double *w_sq, double *u_sq)
{
    (void)b;
    return lamb_moments(p, g, m, v, n, h, grad_scale, eps_inside_sqrt, chunk, w_sq, u_sq);
}

static int cpu_lamb_apply(struct backend *b, float *p, const float *m, const float *v,
                          uint16_t *w16, size_t n, const struct adamw_hparams *h, int step,
                          int eps_inside_sqrt, float coeff)
{
    bool f16 = w16 && b->wdt == BACKEND_F16;
    int r = lamb_apply(p, m, v, f16 ? NULL : w16, n, h, step, eps_inside_sqrt, coeff);
    if (r == 0 && f16) ops_cast_f32_to_f16(w16, p, n);
    return r;
}

static int cpu_digest(struct backend *b, const float *p, size_t n, uint32_t tensor,
                      size_t first_block, uint64_t *sum)
{
    (void)b;
    *sum += digest_floats(p, n, tensor, first_block);
    return 0;
}

/* The same loops as every other fold of the trainer's: a copy, or one addition each. */
static int cpu_fold(struct backend *b, float *g, const float *src, size_t n, int first)
{
    (void)b;
    if (first && src != g)
        memcpy(g, src, n * sizeof(float));
    else if (!first)
        for (size_t j = 0; j < n; j++)
            g[j] += src[j];
    return 0;
}

static int cpu_chunk_sumsq(struct backend *b, const float *g, size_t n, size_t chunk, double *out)
{
    (void)b;
    int r = chunk ? 0 : -EINVAL;
    for (size_t k = 0; k * chunk < n && r == 0; k++)
        r = adamw_sum_squares(g + k * chunk, MIN(chunk, n - k * chunk), &out[k]);
    return r;
}

static int cpu_copy(struct backend *b, void *dst, const void *src, size_t bytes)
{
    (void)b;
    memcpy(dst, src, bytes);
    return 0;
}

static int cpu_grad_io(struct backend *b, void *host, bool put)
{
    struct cpu_backend *c = cpu(b);
    size_t bytes = (size_t)c->B * c->Tl * c->cfg.C * sizeof(float);
    if (put)
        memcpy(c->d, host, bytes);
    else
        memcpy(host, c->d, bytes);
    return 0;
}

static int cpu_cast(struct backend *b, void *dst, const float *src, size_t n)
{
    if (b->wdt == BACKEND_BF16)
        ops_cast_f32_to_bf16(dst, src, n);
    else if (b->wdt == BACKEND_F16)
        ops_cast_f32_to_f16(dst, src, n);
    else
        memcpy(dst, src, n * sizeof(float));
    return 0;
}

/* No streams: the work is done when the call returns. */
static int cpu_event_new(struct backend *b, void **ev)
{
    (void)b;
    *ev = NULL;
    return 0;
}

static void cpu_event_free(struct backend *b, void *ev)
{
    (void)b, (void)ev;
}

static int cpu_event(struct backend *b, void *ev)
{
    (void)b, (void)ev;
    return 0;
}

static int cpu_sync(struct backend *b)
{
    (void)b;
    return 0;
}

static int cpu_collect(struct backend *b, float *loss, double *sumsq)
{
    struct cpu_backend *c = cpu(b);
    *loss = c->loss;
    *sumsq = c->sumsq;
    c->sumsq = 0;
    return 0;
}

static const struct backend_ops cpu_ops = {
    .close = cpu_close,
    .set_batch = cpu_set_batch,
    .zero = cpu_zero,
    .embed_forward = cpu_embed_forward,
    .block_forward = cpu_block_forward,
    .head_backward = cpu_head_backward,
    .block_backward = cpu_block_backward,
    .lora_block_forward = cpu_lora_block_forward,
    .lora_block_backward = cpu_lora_block_backward,
    .embed_backward = cpu_embed_backward,
    .sumsq = cpu_sumsq,
    .adamw = cpu_adamw,
    .adamw_states = cpu_adamw_states,
    .digest = cpu_digest,
    .fold = cpu_fold,
    .chunk_sumsq = cpu_chunk_sumsq,
    .lamb_moments = cpu_lamb_moments,
    .lamb_apply = cpu_lamb_apply,
    .copy = cpu_copy,
    .grad_io = cpu_grad_io,
    .cast = cpu_cast,
    .event_new = cpu_event_new,
    .event_free = cpu_event_free,
    .record = cpu_event,
    .wait = cpu_event,
    .sync = cpu_sync,
    .collect = cpu_collect,
};

int backend_cpu_open(const struct backend_params *p, struct backend **out, char *err, size_t errlen)
{
    *out = NULL;
    int r = backend_params_check(p, err, errlen);
    if (r < 0) return r;
    struct cpu_backend *c = calloc(1, sizeof(*c));
    if (!c) return -ENOMEM;
    c->b = (struct backend){.ops = &cpu_ops, .name = "cpu", .wdt = p->wdt, .adt = backend_act_dtype(false, p->wdt),
                            .loss_scale = 1.0f, .any_thread = 1};
    c->cfg = p->cfg;
    c->B = p->B;
    c->T = p->T;
    c->Vr = p->cfg.V;
    c->Tl = p->T;
    if (p->sp && p->sp->sp > 1) {
        if ((r = gpt_sp_check(&p->cfg, p->sp->sp, p->sp->rank, p->B, p->T, err, errlen)) < 0) {
            free(c);
            return r;
        }
        c->sp = p->sp;
        c->Tl = p->T / p->sp->sp;
    }
    if (p->tp && p->tp->tp > 1) {
        int lo, hi;
        if ((r = gpt_tp_validate(&p->cfg, p->tp->tp, p->tp->rank, err, errlen)) < 0) {
            free(c);
            return r;
        }
        gpt_tp_vocab_range(&p->cfg, p->tp->tp, p->tp->rank, &lo, &hi);
        c->tp = p->tp;
        c->Vr = hi - lo;
    }
    size_t N = (size_t)p->B * c->Tl, C = (size_t)p->cfg.C;
    c->tokens = malloc(N * sizeof(int));
    c->targets = malloc(N * sizeof(int));
    c->d = malloc(N * C * sizeof(float));
    c->scratch.bytes = c->tp   ? gpt_tp_scratch_bytes(&p->cfg, c->tp->tp, p->B, p->T)
                       : c->sp ? gpt_sp_scratch_bytes(&p->cfg, c->sp->sp, p->B, p->T)
                               : gpt_scratch_bytes(&p->cfg, p->B, p->T);
    c->scratch.mem = malloc(c->scratch.bytes);
    int ok = c->tokens && c->targets && c->d && c->scratch.mem;
    if (ok && p->wdt != BACKEND_F32) {
        size_t nb = c->tp ? gpt_tp_block_num_params(&p->cfg, c->tp->tp, c->tp->rank)
                          : gpt_block_num_params(&p->cfg);
        c->wblock = malloc(nb * sizeof(float));
        c->wte = malloc((size_t)p->cfg.V * C * sizeof(float));
        c->wpe = malloc((size_t)p->cfg.maxT * C * sizeof(float));
        c->lnfw = malloc(C * sizeof(float));
        c->lnfb = malloc(C * sizeof(float));
        ok = c->wblock && c->wte && c->wpe && c->lnfw && c->lnfb;
        if (ok) {
            /* The slots lie in order in a contiguous block: each one's size is the distance
             * to the next. */
            struct gpt_block_params bp;
            if (c->tp)
                gpt_tp_block_params_at(&p->cfg, c->tp->tp, c->tp->rank, c->wblock, &bp);
            else
                gpt_block_params_at(&p->cfg, c->wblock, &bp);
            for (int i = 0; i < GPT_BLOCK_NSLOTS; i++)
                c->slot_numel[i] =
                    (size_t)((i + 1 < GPT_BLOCK_NSLOTS ? bp.t[i + 1] : c->wblock + nb) - bp.t[i]);
        }
    }
    if (!ok) {
        snprintf(err, errlen, "out of memory for the CPU backend's working buffers");
        cpu_close(&c->b);
        return -ENOMEM;
    }
    c->moe = (struct backend_cpu_view){.cfg = &c->cfg, .B = c->B, .T = c->T, .d = c->d,
                                       .gs = &c->scratch};
    if (!c->tp && !c->sp) c->b.moe = &backend_cpu_moe_ops;
    *out = &c->b;
    return 0;
}
