/*
 * kernels.h - launchers of the CUDA kernels. Each takes a cudaStream_t, checks its launch
 * and returns 0 or -errno; each kernel has a CPU reference twin elsewhere in the tree and a
 * test comparing them (tests/test_kernels.c). Declared only in builds with CUDA.
 */
#ifndef ZINF_KERNELS_KERNELS_H
#define ZINF_KERNELS_KERNELS_H

#include <stddef.h>

#include "train/adamw.h"

#ifdef __cplusplus
extern "C" {
#endif

#include <cuda_runtime_api.h>

/* AdamW over n elements of device memory, in place; the twin of adamw_update_isa(SCALAR). */
int kernel_adamw(float *param, const float *grad, float *m, float *v, size_t n,
                 const struct adamw_hparams *h, int step, float grad_scale, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
