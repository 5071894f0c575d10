/*
 * onebit_ref.c - zinf's 1-bit Adam (train/onebit.h) on one tensor for W ranks in one
 * process, the collectives replaced by copies between the ranks' buffers, driven from a
 * pipe, so that bench/onebit_check.py can put it beside DeepSpeed's arithmetic on the same
 * numbers.
 *
 *   onebit_ref W N STEPS FREEZE_STEP LR BETA1 BETA2 EPS WEIGHT_DECAY
 *
 * stdin: param (N fp32), then for each step W gradients (N fp32 each: rank w's own, its
 * micro-batches' mean). Updates 1..FREEZE_STEP are Adam's without bias correction on the
 * ranks' mean (summed in rank order, then times 1 / W, as the trainer's reduction and scale),
 * the later ones the compressed exchange of each rank's momentum (onebit.c's functions).
 * stdout: param, m, v (N fp32 each; every rank holds the same), then the worker errors
 * (W x Np, Np the padded N) and the server errors (W x Np / W).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/adamw.h"
#include "train/onebit.h"

#define MAXW 16

int main(int argc, char **argv)
{
    if (argc != 10) {
        fprintf(stderr, "usage: onebit_ref W N STEPS FREEZE_STEP LR BETA1 BETA2 EPS "
                        "WEIGHT_DECAY\n");
        return 2;
    }
    int W = atoi(argv[1]), steps = atoi(argv[3]), freeze = atoi(argv[4]);
    size_t n = strtoull(argv[2], NULL, 10);
    struct adamw_hparams h = {.lr = strtof(argv[5], NULL),
                              .beta1 = strtof(argv[6], NULL),
                              .beta2 = strtof(argv[7], NULL),
                              .eps = strtof(argv[8], NULL),
                              .weight_decay = strtof(argv[9], NULL),
                              .no_bias_correction = 1};
    if (W < 1 || W > MAXW || !n) {
        fprintf(stderr, "onebit_ref: W in [1, %d], N > 0\n", MAXW);
        return 2;
    }
    size_t N = onebit_padded(n, W), chunk = N / (size_t)W, cb = chunk / 8;
    float *p = malloc(n * sizeof(float)), *v = calloc(n, sizeof(float)),
          *g = malloc((size_t)W * n * sizeof(float)), *sum = malloc(n * sizeof(float));
    float *m[MAXW], *werr[MAXW], *serr[MAXW];
    uint8_t *bits[MAXW], *recv = malloc(N / 8 * (size_t)W), *sbits = malloc(N / 8);
    for (int w = 0; w < W; w++) {
        m[w] = calloc(n, sizeof(float));
        werr[w] = calloc(N, sizeof(float));
        serr[w] = calloc(chunk, sizeof(float));
        bits[w] = malloc(N / 8);
    }
    if (fread(p, sizeof(float), n, stdin) != n) return 1;
    for (int s = 1; s <= steps; s++) {
        if (fread(g, sizeof(float), (size_t)W * n, stdin) != (size_t)W * n) return 1;
        if (s <= freeze) {
            memcpy(sum, g, n * sizeof(float));
            for (int w = 1; w < W; w++)
                for (size_t j = 0; j < n; j++)
                    sum[j] += g[(size_t)w * n + j];
            adamw_update(p, sum, m[0], v, n, &h, s, 1.0f / (float)W);
            for (int w = 1; w < W; w++)
                memcpy(m[w], m[0], n * sizeof(float));
            continue;
        }
        float ws[MAXW], ss[MAXW];
        for (int w = 0; w < W; w++) {
            onebit_momentum(m[w], g + (size_t)w * n, n, h.beta1, 1.0f);
            if (W > 1) ws[w] = onebit_compress(m[w], n, werr[w], N, bits[w]);
        }
        if (W > 1) {
            /* Server r's alltoall: rank w's signs of chunk r; then its own signs, gathered. */
            for (int r = 0; r < W; r++) {
                const uint8_t *from[MAXW];
                for (int w = 0; w < W; w++) {
                    memcpy(recv + (size_t)w * cb, bits[w] + (size_t)r * cb, cb);
                    from[w] = recv + (size_t)w * cb;
                }
                ss[r] = onebit_server(from, ws, W, serr[r], chunk, sbits + (size_t)r * cb);
            }
            for (int w = 0; w < W; w++)
                onebit_expand(sbits, ss, W, chunk, m[w], n);
        }
        onebit_apply(p, m[0], v, n, h.lr, h.eps, h.weight_decay);
    }
    fwrite(p, sizeof(float), n, stdout);
    fwrite(m[0], sizeof(float), n, stdout);
    fwrite(v, sizeof(float), n, stdout);
    for (int w = 0; w < W; w++)
        fwrite(werr[w], sizeof(float), N, stdout);
    for (int w = 0; w < W; w++)
        fwrite(serr[w], sizeof(float), chunk, stdout);
    return 0;
}
