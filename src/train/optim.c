/*
 * optim.c - the optimizer step zinf.h offers to trainers built on the library
 * (zinf_adamw_step): a checked front of the AdamW kernels of adamw.c, which the
 * library's own trainer uses too.
 *
 * Not here: where the parameters and states live (the caller fetches them), the kernels.
 */
#include <errno.h>

#include "train/adamw.h"
#include "zinf.h"

void zinf_adamw_defaults(struct zinf_adamw *h)
{
    if (h) *h = (struct zinf_adamw){.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                                    .weight_decay = 0.01f};
}

int zinf_adamw_step(const struct zinf_adamw *h, int step, float *param, const float *grad,
                    float *m, float *v, size_t n, float grad_scale)
{
    if (!h) return -EINVAL;
    for (int i = 0; i < 4; i++)
        if (h->reserved[i]) return -EINVAL;
    struct adamw_hparams hp = {.lr = h->lr,
                               .beta1 = h->beta1,
                               .beta2 = h->beta2,
                               .eps = h->eps,
                               .weight_decay = h->weight_decay};
    /* adamw_update checks the ranges, the buffers, the step and the scale. */
    return adamw_update(param, grad, m, v, n, &hp, step, grad_scale);
}
