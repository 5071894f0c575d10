/*
 * emu.h - what the CUDA kernels of kernels/ see when they are compiled as C++ for the CPU
 * emulation (run.sh force-includes it into every kernel file that rewrite.py produced).
 * The function qualifiers vanish, __shared__ arrays become statics, and threadIdx,
 * blockIdx, blockDim, gridDim, __syncthreads() and the warp shuffles are backed by the
 * fiber scheduler of emu_rt.cpp; a launch becomes an emu_launch() call that queues the
 * kernel on its stream.
 *
 * Not here: the runtime and cuBLAS entry points (emu_rt.cpp, declared by the CUDA
 * toolkit's own headers), and any device feature the kernels do not use: 2-D/3-D blocks,
 * dynamic shared memory, atomics, shuffles other than __shfl_xor_sync with a full mask.
 * A __shared__ static is one array for every block, which is right only because the
 * emulator runs one block at a time.
 */
#pragma once

/* Defined before the CUDA headers, which then keep them: outside nvcc they define only
 * the qualifiers that are not defined yet, as attributes g++ does not know. */
#define __global__
#define __device__
#define __host__
#define __shared__ static

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <functional>

/* The kernel files call isfinite() unqualified, as C and CUDA code may. */
using std::isfinite;

/* The current thread's coordinates. Only the fiber scheduler writes them, and only one
 * kernel runs at a time in the process. */
extern dim3 threadIdx, blockIdx, blockDim, gridDim;

void __syncthreads();
double emu_shfl_xor(double v, int lane_mask);
inline float __shfl_xor_sync(unsigned, float v, int lane_mask)
{
    return (float)emu_shfl_xor(v, lane_mask);
}
inline double __shfl_xor_sync(unsigned, double v, int lane_mask)
{
    return emu_shfl_xor(v, lane_mask);
}

/* The explicitly rounded intrinsics: one IEEE operation each, as on the GPU, and never
 * contracted into an FMA. */
inline float __fmul_rn(float a, float b)
{
    return a * b;
}
inline float __fadd_rn(float a, float b)
{
    return a + b;
}
inline float __fsub_rn(float a, float b)
{
    return a - b;
}
inline float __fmaf_rn(float a, float b, float c)
{
    return fmaf(a, b, c);
}
inline float __fdiv_rn(float a, float b)
{
    return a / b;
}
inline float __fsqrt_rn(float a)
{
    return sqrtf(a);
}

/* Queues body (the kernel call with its arguments captured by value) on stream s, to run
 * once per thread of a grid of blocks of b threads. What rewrite.py turns
 * `kernel<<<grid, block, shmem, stream>>>(args)` into. */
void emu_launch(dim3 grid, dim3 block, size_t shmem_bytes, cudaStream_t s,
                std::function<void()> body);

/* For the other emulated libraries (emu_nccl.cpp): queue op on stream s, ordered with its
 * kernels, copies and event waits as they are; abort unless [p, p + n) lies in one device
 * allocation (what names the caller in the message). */
void emu_enqueue(cudaStream_t s, std::function<void()> op);
void emu_need_device(const void *p, size_t n, const char *what);
