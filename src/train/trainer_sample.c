/*
 * trainer_sample.c - what a run computes beside training, reusing the step's forward:
 * the loss on the held-out tail of the data (trainer_eval), and text sampled from the
 * model after a prompt (trainer_sample).
 *
 * Not here: the forward itself and the sets it pins (trainer_step.c), or the batches of
 * training (trainer.c).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common.h"
#include "train/backend.h"
#include "train/ops.h"
#include "train/trainer_impl.h"

int trainer_eval(struct trainer *t, int n_batches, float *loss)
{
    int B = t->o.batch, T = t->o.seq, r = 0;
    if (t->torn) return t->torn;
    if (n_batches < 1 || !loss) return -EINVAL;
    if (t->train_bytes == t->data_bytes) return -ENODATA;
    /* Window starts spread evenly over the tail, the last one ending at the data's end. */
    size_t first = t->train_bytes, span = t->data_bytes - t->train_bytes - (size_t)T - 1;
    size_t windows = (size_t)n_batches * (size_t)B;
    double sum = 0;
    for (int j = 0; j < n_batches && r == 0; j++) {
        for (int b = 0; b < B; b++) {
            size_t k = (size_t)j * (size_t)B + (size_t)b;
            size_t off = first + (windows > 1 ? span * k / (windows - 1) : 0);
            for (int i = 0; i < T; i++) {
                t->tokens[b * T + i] = t->data[off + (size_t)i];
                t->targets[b * T + i] = t->data[off + (size_t)i + 1];
            }
        }
        float l = 0;
        double ss;
        if ((r = t->be->ops->set_batch(t->be, t->tokens, t->targets)) == 0 &&
            (r = train_forward(t)) == 0 && (r = train_head(t, true, false, false)) == 0 &&
            (r = t->be->ops->collect(t->be, &l, &ss)) == 0)
            sum += l;
    }
    if (r < 0) {
        float l;
        double d;
        t->be->ops->collect(t->be, &l, &d);
        return r;
    }
    *loss = (float)(sum / n_batches);
    return 0;
}

/* Sampling's fp32 weights (the final norm's and wte), entries 1-3 of its set: as fetched, or
 * at stage 3 across ranks, where each rank holds a shard of them, gathered from every rank
 * into whole (world x their shards) through the host communicator. */
static int sample_weights(struct trainer *t, void **p, float *whole, const float *out[3])
{
    const int idx[3] = {t->lnfw, t->lnfb, t->wte};
    for (int k = 0; k < 3 && whole; k++) {
        if (train_stage_of(t, idx[k]) < 3) continue;
        size_t sh = train_shard_of(t, idx[k]);
        int r = comm_allgather(t->hcomm, p[k + 1], whole, sh, COMM_F32);
        if (r < 0) return r;
        out[k] = whole;
        whole += (size_t)t->world * sh;
    }
    return 0;
}

int trainer_sample(struct trainer *t, uint64_t seed, const unsigned char *prompt, size_t plen,
                   unsigned char *out, size_t n)
{
    int B = t->o.batch, T = t->o.seq, C = t->cfg.C, V = t->cfg.V, r = 0;
    float logits[256], mean, rstd;
    size_t done = 0;

    if ((r = train_update_finish(t)) < 0) return r;
    if (!t->o.sample || !prompt || plen < 1 || !out || plen + n > (size_t)T) return -EINVAL;
    unsigned char *ctx = malloc((size_t)T);
    float *x = malloc((size_t)C * sizeof(float)), *xn = malloc((size_t)C * sizeof(float));
    float *whole = NULL;
    if (t->world > 1 && t->stage >= 3)
        whole = malloc((size_t)t->world * sizeof(float) *
                       (train_shard_of(t, t->lnfw) + train_shard_of(t, t->lnfb) +
                        train_shard_of(t, t->wte)));
    if (!ctx || !x || !xn || (t->world > 1 && t->stage >= 3 && !whole)) {
        free(ctx);
        free(x);
        free(xn);
        free(whole);
        return -ENOMEM;
    }
    memcpy(ctx, prompt, plen);
    for (size_t pos = plen - 1; done < n && r == 0; pos++) {
        for (int b = 0; b < B; b++)
            for (int i = 0; i < T; i++) {
                t->tokens[b * T + i] = i <= (int)pos ? ctx[i] : 0;
                t->targets[b * T + i] = 0;
            }
        if ((r = t->be->ops->set_batch(t->be, t->tokens, t->targets)) < 0 ||
            (r = train_forward(t)) < 0)
            break;
        struct wave w;
        void *p[WAVE_MAX];
        train_wave_sample(t, &w);
        if ((r = train_wave_fetch(t, &w, ZINF_TIER_HOST, p)) < 0) break;
        /* Row 0's activation at pos, through the final norm, against each byte's embedding. */
        size_t at = pos * (size_t)C;
        if (t->be->adt == BACKEND_BF16)
            ops_cast_bf16_to_f32(x, (const uint16_t *)p[0] + at, (size_t)C);
        else
            memcpy(x, (const float *)p[0] + at, (size_t)C * sizeof(float));
        const float *lnf[3] = {p[1], p[2], p[3]};
        if ((r = sample_weights(t, p, whole, lnf)) < 0) {
            train_wave_release(t, &w, ZINF_TIER_HOST, false);
            break;
        }
        ops_layernorm_forward(xn, &mean, &rstd, x, lnf[0], lnf[1], 1, (size_t)C);
        const float *wte = lnf[2];
        float mx = -INFINITY;
        for (int v = 0; v < V; v++) {
            double dot = 0;
            for (int c = 0; c < C; c++)
                dot += (double)wte[(size_t)v * C + c] * xn[c];
            logits[v] = (float)dot;
            mx = MAX(mx, logits[v]);
        }
        train_wave_release(t, &w, ZINF_TIER_HOST, false);
        double z = 0;
        for (int v = 0; v < V; v++)
            z += exp((double)logits[v] - mx);
        double u = (double)(train_mix64(seed * 0x9e3779b97f4a7c15ull + pos) >> 11) * 0x1p-53 * z;
        int tok = V - 1;
        for (int v = 0; v < V; v++) {
            u -= exp((double)logits[v] - mx);
            if (u <= 0) {
                tok = v;
                break;
            }
        }
        ctx[pos + 1] = (unsigned char)tok;
        out[done++] = (unsigned char)tok;
        if (pos + 2 >= (size_t)T) break;
    }
    free(ctx);
    free(x);
    free(xn);
    free(whole);
    if (r < 0) {
        float l;
        double d;
        t->be->ops->collect(t->be, &l, &d);
        return r;
    }
    return (int)done;
}
