/*
 * optim_ref.c - zinf's Adam (with adam_w_mode false: L2 in the gradient) and LAMB kernels on
 * one tensor, driven from a pipe, so that bench/ds_optim.py can put them side by side with
 * DeepSpeed's optimizers on the same numbers.
 *
 *   optim_ref adam-l2|lamb N STEPS LR BETA1 BETA2 EPS WEIGHT_DECAY BIAS_CORRECTION
 *             [MAX_COEFF MIN_COEFF EPS_INSIDE_SQRT]
 *
 * stdin: param, m, v (N fp32 each), then STEPS gradients (N fp32 each); stdout: param, m, v
 * after the steps, then (lamb) the STEPS trust ratios as fp32. Steps count from 1.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/adamw.h"

#define CHUNK 1024 /* the trainer's chunk of the ratio's sums */

static int read_all(float *x, size_t n)
{
    return fread(x, sizeof(float), n, stdin) == n ? 0 : -1;
}

int main(int argc, char **argv)
{
    if (argc < 10 || (strcmp(argv[1], "adam-l2") && strcmp(argv[1], "lamb")) ||
        (!strcmp(argv[1], "lamb") && argc < 13)) {
        fprintf(stderr, "usage: optim_ref adam-l2|lamb N STEPS LR BETA1 BETA2 EPS WEIGHT_DECAY "
                        "BIAS_CORRECTION [MAX_COEFF MIN_COEFF EPS_INSIDE_SQRT]\n");
        return 2;
    }
    bool lamb = !strcmp(argv[1], "lamb");
    size_t n = strtoull(argv[2], NULL, 10);
    int steps = atoi(argv[3]);
    struct adamw_hparams h = {.lr = strtof(argv[4], NULL),
                              .beta1 = strtof(argv[5], NULL),
                              .beta2 = strtof(argv[6], NULL),
                              .eps = strtof(argv[7], NULL),
                              .weight_decay = strtof(argv[8], NULL),
                              .l2 = !lamb,
                              .no_bias_correction = !atoi(argv[9])};
    float maxc = lamb ? strtof(argv[10], NULL) : 0, minc = lamb ? strtof(argv[11], NULL) : 0;
    int inside = lamb ? atoi(argv[12]) : 0;
    size_t chunks = (n + CHUNK - 1) / CHUNK;
    float *p = malloc(n * sizeof(float)), *m = malloc(n * sizeof(float)),
          *v = malloc(n * sizeof(float)), *g = malloc(n * sizeof(float)),
          *coeffs = calloc((size_t)steps + 1, sizeof(float));
    double *w = calloc(chunks + 1, sizeof(double)), *u = calloc(chunks + 1, sizeof(double));
    if (!p || !m || !v || !g || !coeffs || !w || !u || steps < 1) return 1;
    if (read_all(p, n) || read_all(m, n) || read_all(v, n)) {
        fprintf(stderr, "optim_ref: short input\n");
        return 1;
    }
    for (int s = 1; s <= steps; s++) {
        if (read_all(g, n)) {
            fprintf(stderr, "optim_ref: short input at step %d's gradient\n", s);
            return 1;
        }
        int r;
        if (!lamb) {
            r = adamw_update(p, g, m, v, n, &h, s, 1.0f);
        } else if ((r = lamb_moments(p, g, m, v, n, &h, 1.0f, inside, CHUNK, w, u)) == 0) {
            double W = 0, U = 0;
            for (size_t k = 0; k < chunks; k++) {
                W += w[k];
                U += u[k];
            }
            coeffs[s - 1] = lamb_coeff(W, U, maxc, minc);
            r = lamb_apply(p, m, v, NULL, n, &h, s, inside, coeffs[s - 1]);
        }
        if (r < 0) {
            fprintf(stderr, "optim_ref: step %d: error %d\n", s, r);
            return 1;
        }
    }
    fwrite(p, sizeof(float), n, stdout);
    fwrite(m, sizeof(float), n, stdout);
    fwrite(v, sizeof(float), n, stdout);
    if (lamb) fwrite(coeffs, sizeof(float), (size_t)steps, stdout);
    return fflush(stdout) == 0 ? 0 : 1;
}
