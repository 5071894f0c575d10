/* cuda_copy.h - a plain pinned H2D copy figure for the GPU benchmarks (see cuda_copy.c). */
#ifndef ZINF_BENCH_CUDA_COPY_H
#define ZINF_BENCH_CUDA_COPY_H

#include <stddef.h>

/* *gbps = bytes x reps / time of reps pinned cudaMemcpyAsync H2D copies on GPU ordinal;
 * -ENODEV in builds without CUDA, -EIO when a CUDA call fails. */
int bench_pinned_h2d(int ordinal, size_t bytes, int reps, double *gbps);

#endif
