/*
 * onebit.c - 1-bit Adam (onebit.h): the compression and its errors, the exchange of the
 * momentum across ranks, and the compressed phase's update of a tensor.
 *
 * Not here: the config's keys (onebit_config.c), the warm-up's Adam (adamw.c through
 * trainer_optim.c), the reductions the compressed phase skips (trainer_shards.c).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common.h"
#include "train/adamw.h"
#include "train/backend.h"
#include "train/onebit.h"
#include "train/ops.h"
#include "train/trainer_impl.h"

/* One tensor's state past freeze_step: the whole m and v (the registered ones are the
 * rank's shards; on one rank those themselves), the worker's error (N) and the server's
 * (N / world). */
struct onebit_tensor {
    float *m, *v, *werr, *serr;
    bool own_mv; /* m and v are copies of this file's (several ranks) */
};

/* The rank's exchange buffers, sized for the largest tensor. */
struct onebit {
    struct onebit_tensor *ts;
    uint8_t *bits, *send, *recv, *sbits; /* send, recv: world blocks of signs and a scale */
    float scales[COMM_MAX_RANKS], sscales[COMM_MAX_RANKS];
    float *gathered; /* world x shard floats: m's and v's shards gathered */
};

static size_t gcd(size_t a, size_t b)
{
    while (b) {
        size_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

size_t onebit_padded(size_t n, int world)
{
    size_t w = (size_t)world, unit = w * (w * 8 / gcd(w, 8));
    return (n + unit - 1) / unit * unit;
}

/* The elementwise loops, also compiled for AVX2 and FMA (chosen when the library loads):
 * fmaf, sqrtf and the divisions are correctly rounded either way, so both give the same
 * bits; the vector one is several times faster than the baseline's calls of fmaf. A sign
 * times a scale is +-scale exactly, which is how they are written. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) &&                         \
    !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
/* (Not under the sanitizers: the clones' resolvers run while the program is relocated,
 * before a sanitizer's runtime is up, and an instrumented one crashes there.) */
#define ELEMENTWISE __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ELEMENTWISE
#endif

/* x's scale |x| / sqrt(N), its signs into bits, and err = x - scale x sign. */
ELEMENTWISE static float compress(float *x, size_t N, uint8_t *bits)
{
    double ss = 0;
    for (size_t j = 0; j < N; j++)
        ss += (double)x[j] * x[j];
    float scale = (float)(sqrt(ss) / sqrt((double)N));
    for (size_t b = 0; b < N / 8; b++) {
        unsigned byte = 0;
        for (unsigned k = 0; k < 8; k++) {
            float v = x[8 * b + k];
            bool pos = !(v < 0); /* DeepSpeed's sign().add_(1).bool(): 0 is +1 */
            byte |= (unsigned)pos << (7 - k);
            x[8 * b + k] = v - (pos ? scale : -scale);
        }
        bits[b] = (uint8_t)byte;
    }
    return scale;
}

ELEMENTWISE float onebit_compress(const float *m, size_t n, float *werr, size_t N,
                                  uint8_t *bits)
{
    for (size_t j = 0; j < N; j++)
        werr[j] += j < n ? m[j] : 0.0f;
    return compress(werr, N, bits);
}

ELEMENTWISE float onebit_server(const uint8_t *const *bits, const float *scales, int world,
                                float *serr, size_t chunk, uint8_t *out)
{
    float per[COMM_MAX_RANKS];
    for (int w = 0; w < world; w++)
        per[w] = scales[w] * (1.0f / (float)world);
    /* Eight elements at a time, each summed over the ranks in rank order. */
    for (size_t b = 0; b < chunk / 8; b++) {
        float c[8];
        for (unsigned k = 0; k < 8; k++)
            c[k] = bits[0][b] >> (7 - k) & 1 ? per[0] : -per[0];
        for (int w = 1; w < world; w++)
            for (unsigned k = 0; k < 8; k++)
                c[k] += bits[w][b] >> (7 - k) & 1 ? per[w] : -per[w];
        for (unsigned k = 0; k < 8; k++)
            serr[8 * b + k] += c[k];
    }
    return compress(serr, chunk, out);
}

ELEMENTWISE void onebit_expand(const uint8_t *bits, const float *scales, int world,
                               size_t chunk, float *m, size_t n)
{
    /* chunk is a multiple of 8: a byte's elements share their server's scale. */
    for (size_t b = 0; b < (n + 7) / 8; b++) {
        float s = scales[b * 8 / chunk], e[8];
        for (unsigned k = 0; k < 8; k++)
            e[k] = bits[b] >> (7 - k) & 1 ? s : -s;
        memcpy(m + 8 * b, e, MIN(8, n - 8 * b) * sizeof(float));
    }
}

ELEMENTWISE void onebit_momentum(float *m, const float *g, size_t n, float b1, float gs)
{
    float omb1 = 1.0f - b1;
    for (size_t j = 0; j < n; j++)
        m[j] = fmaf(b1, m[j], omb1 * (g[j] * gs));
}

ELEMENTWISE void onebit_apply(float *p, const float *m, const float *v, size_t n, float lr,
                              float eps, float wd)
{
    for (size_t j = 0; j < n; j++) {
        float u = m[j] / (sqrtf(v[j]) + eps);
        u = fmaf(wd, p[j], u);
        p[j] = fmaf(-lr, u, p[j]);
    }
}

int train_onebit_check(struct trainer *t, bool cuda, char *err, size_t errlen)
{
    if (t->o.optimizer != TRAINER_OPT_ONEBIT) return 0;
    const char *key = NULL, *what = NULL;
    if (cuda)
        key = "zinf.train.backend", what = "GPU ranks (1-bit Adam runs on CPU ranks)";
    else if (t->zc.zero.stage >= 2)
        key = "zero_optimization.stage", what = "ZeRO stages 2 and 3 (stages 0 and 1 run it)";
    else if (t->pp > 1)
        key = "pipeline.stages", what = "pipeline stages";
    else if (t->tp > 1)
        key = "tensor_parallel.autotp_size", what = "tensor-parallel ranks";
    else if (t->sp > 1)
        key = "sequence_parallel_size", what = "sequence-parallel ranks";
    else if (t->o.moe.E)
        key = "moe", what = "mixture-of-experts blocks";
    if (!key) return 0;
    snprintf(err, errlen, "optimizer.type \"OneBitAdam\" with %s: not with %s", key, what);
    return -EINVAL;
}

bool train_onebit_local(const struct trainer *t)
{
    return t->o.optimizer == TRAINER_OPT_ONEBIT &&
           t->step_done + 1 - (int)t->ls.skipped > t->o.freeze_step;
}

void train_onebit_free(struct trainer *t)
{
    struct onebit *ob = t->onebit;
    if (!ob) return;
    for (int i = 0; ob->ts && i < t->ntensors; i++) {
        struct onebit_tensor *x = &ob->ts[i];
        if (x->own_mv) {
            free(x->m);
            free(x->v);
        }
        free(x->werr);
        free(x->serr);
    }
    free(ob->ts);
    free(ob->bits);
    free(ob->send);
    free(ob->recv);
    free(ob->sbits);
    free(ob->gathered);
    free(ob);
    t->onebit = NULL;
}

/* The rank's buffers, sized for the largest tensor, on the first compressed update. */
static int onebit_alloc(struct trainer *t)
{
    if (t->onebit) return 0;
    size_t most = 0, shard = 0;
    for (int i = 0; i < t->ntensors; i++) {
        most = MAX(most, onebit_padded(t->desc[i].numel, t->world));
        shard = MAX(shard, train_shard_of(t, i));
    }
    struct onebit *ob = calloc(1, sizeof(*ob));
    if (!ob) return -ENOMEM;
    t->onebit = ob;
    ob->ts = calloc((size_t)t->ntensors, sizeof(*ob->ts));
    size_t blocks = most / 8 + (size_t)t->world * sizeof(float);
    ob->bits = malloc(most / 8);
    ob->send = malloc(blocks);
    ob->recv = malloc(blocks);
    ob->sbits = malloc(most / 8 / (size_t)t->world + sizeof(float));
    ob->gathered = t->world > 1 ? malloc((size_t)t->world * shard * sizeof(float)) : NULL;
    if (!ob->ts || !ob->bits || !ob->send || !ob->recv || !ob->sbits ||
        (t->world > 1 && !ob->gathered)) {
        log_error("train: 1-bit Adam's exchange buffers (%zu bytes a rank): out of memory",
                  2 * most / 8 + (size_t)t->world * shard * sizeof(float));
        return -ENOMEM;
    }
    return 0;
}

/* The whole tensor i of a shard-sized registered state (m or v: the rank's own part at its
 * shard's place), gathered into whole (n floats). */
static int gather_state(struct trainer *t, int i, const float *mine, float *whole)
{
    size_t n = t->desc[i].numel, sh = train_shard_of(t, i), own = train_shard_own(t, i);
    float *send = t->onebit->gathered + (size_t)t->rank * sh;
    memcpy(send, mine, own * sizeof(float));
    memset(send + own, 0, (sh - own) * sizeof(float));
    int r = comm_allgather(t->hcomm, send, t->onebit->gathered, sh * sizeof(float), COMM_BYTE);
    if (r == 0) memcpy(whole, t->onebit->gathered, n * sizeof(float));
    return r;
}

/* Tensor i's state on its first compressed update in this process: m and v whole (gathered
 * from their shards on several ranks), the errors zero. */
static int tensor_state(struct trainer *t, int i, void **p, struct onebit_tensor **out)
{
    int r = onebit_alloc(t);
    if (r < 0) return r;
    struct onebit_tensor *x = &t->onebit->ts[i];
    *out = x;
    if (x->werr) return 0;
    size_t n = t->desc[i].numel, N = onebit_padded(n, t->world);
    if (t->world > 1) {
        x->own_mv = true;
        if (!(x->m = malloc(n * sizeof(float))) || !(x->v = malloc(n * sizeof(float)))) goto oom;
        if ((r = gather_state(t, i, p[2], x->m)) < 0 || (r = gather_state(t, i, p[3], x->v)) < 0)
            return r;
    }
    if (!(x->werr = calloc(N, sizeof(float))) ||
        !(x->serr = calloc(N / (size_t)t->world, sizeof(float))))
        goto oom;
    return 0;
oom:
    log_error("train: 1-bit Adam's state of %s (%zu floats): out of memory", t->desc[i].name, N);
    return -ENOMEM;
}

/* DeepSpeed's compressed_allreduce of m (n floats) over the ranks, in two collectives: an
 * alltoall of each server's chunk of signs with the worker's scale behind it, and an
 * allgather of each server's signs with its scale behind them (blocks of chunk / 8 + 4
 * bytes). The bytes this rank sent are added to t->grad_bytes. */
static int exchange(struct trainer *t, struct onebit_tensor *x, float *m, size_t n)
{
    struct onebit *ob = t->onebit;
    int W = t->world;
    size_t N = onebit_padded(n, W), chunk = N / (size_t)W, cb = chunk / 8,
           blk = cb + sizeof(float);
    float ws = onebit_compress(m, n, x->werr, N, ob->bits);
    for (int w = 0; w < W; w++) {
        memcpy(ob->send + (size_t)w * blk, ob->bits + (size_t)w * cb, cb);
        memcpy(ob->send + (size_t)w * blk + cb, &ws, sizeof(ws));
    }
    int r = comm_alltoall(t->hcomm, ob->send, ob->recv, blk, COMM_BYTE);
    if (r < 0) return r;
    const uint8_t *from[COMM_MAX_RANKS];
    for (int w = 0; w < W; w++) {
        from[w] = ob->recv + (size_t)w * blk;
        memcpy(&ob->scales[w], from[w] + cb, sizeof(float));
    }
    float ss = onebit_server(from, ob->scales, W, x->serr, chunk, ob->sbits);
    memcpy(ob->sbits + cb, &ss, sizeof(ss));
    if ((r = comm_allgather(t->hcomm, ob->sbits, ob->recv, blk, COMM_BYTE)) == 0)
        for (int w = 0; w < W && (size_t)w * chunk < n; w++) {
            const uint8_t *b = ob->recv + (size_t)w * blk;
            memcpy(&ob->sscales[w], b + cb, sizeof(float));
            onebit_expand(b, &ob->sscales[w], 1, chunk, m + (size_t)w * chunk,
                          MIN(chunk, n - (size_t)w * chunk));
        }
    /* The signs and scale to every server; the served chunk's signs and scale. */
    t->grad_bytes += (uint64_t)W * blk + blk;
    return r;
}

int train_onebit_update(struct trainer *t, int i, void **p, const struct adamw_hparams *h,
                        float gs)
{
    struct onebit_tensor *x;
    int r = tensor_state(t, i, p, &x);
    if (r < 0) return r;
    size_t n = t->desc[i].numel;
    float *m = x->own_mv ? x->m : p[2], *v = x->own_mv ? x->v : p[3], *pp = p[0];
    onebit_momentum(m, p[1], n, h->beta1, gs);
    if (t->world > 1 && (r = exchange(t, x, m, n)) < 0) return r;
    /* Every rank holds the same m and v: each updates the whole parameter, the same bits. */
    onebit_apply(pp, m, v, n, h->lr, h->eps, h->weight_decay);
    if (t->w != t->p) { /* mixed precision: the 16-bit copy, whole */
        if (t->be->wdt == BACKEND_F16)
            ops_cast_f32_to_f16(p[4], pp, n);
        else
            ops_cast_f32_to_bf16(p[4], pp, n);
    }
    /* The registered m holds the rank's part, for a checkpoint. */
    if (x->own_mv) {
        size_t lo = MIN(train_shard_lo(t, i), n);
        memcpy(p[2], m + lo, train_shard_own(t, i) * sizeof(float));
    }
    return 0;
}
