/*
 * adamw_hparams.h - the hyperparameters of one AdamW step, shared by the CPU optimizer
 * (src/train/adamw.h) and the CUDA kernels (kernels/kernels.h), which sit below the
 * trainer and must not include it. Plain C: it compiles without the CUDA headers.
 *
 * Not here: the update itself, its defaults or the clipping helpers (src/train/adamw.h).
 */
#ifndef ZINF_ADAMW_HPARAMS_H
#define ZINF_ADAMW_HPARAMS_H

struct adamw_hparams {
    float lr;           /* learning rate, >= 0 */
    float beta1, beta2; /* in [0, 1) */
    float eps;          /* > 0 */
    float weight_decay; /* >= 0, decoupled: applied to the parameter, not the gradient */
    int l2;             /* nonzero: weight_decay is L2 regularisation instead, added to the
                           gradient (weight_decay x param) before the moments (DeepSpeed's
                           Adam with adam_w_mode false) */
    int no_bias_correction; /* nonzero: m and v are used as they are (bias_correction false) */
};

#endif
