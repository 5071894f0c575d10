/*
 * adamw_int.h - the AdamW kernels of adamw.c for the other optimizer files of src/train: the
 * per-step constants in the form every kernel takes them and the kernel adamw_update() would
 * pick, so that an update over states kept in another type (adamw_states.c) widens them to
 * fp32 and runs the very same arithmetic on them, block by block.
 *
 * Not here: the public entry points (adamw.h), the compressed states (adamw_states.h).
 */
#ifndef ZINF_TRAIN_ADAMW_INT_H
#define ZINF_TRAIN_ADAMW_INT_H

#include <stddef.h>

#include "train/adamw.h"

/* The per-step constants, in the form every kernel uses them. */
struct adamw_coeffs {
    float gs;       /* grad_scale */
    float b1, omb1; /* beta1, 1 - beta1 */
    float b2, omb2; /* beta2, 1 - beta2 */
    float bc1, bc2; /* 1 / (1 - beta^step), the bias corrections */
    float eps, wd, lr;
    int l2; /* wd is L2 in the gradient, not a decoupled decay */
};

/* One kernel over n elements, in place on p, m and v: any n, any alignment. */
typedef void (*adamw_kernel_fn)(float *p, const float *g, float *m, float *v, size_t n,
                                const struct adamw_coeffs *c);

struct adamw_kernel {
    adamw_kernel_fn fn;
    struct adamw_coeffs c;
    enum adamw_isa isa; /* the one fn is: never ADAMW_ISA_BEST */
};

/* The kernel for isa (ADAMW_ISA_BEST: the best this CPU runs) and step's constants; -EINVAL
 * and -ENOTSUP as adamw_update_isa. */
int adamw_prepare(enum adamw_isa isa, const struct adamw_hparams *h, int step, float grad_scale,
                  struct adamw_kernel *k);

#endif
