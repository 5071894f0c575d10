/*
 * cuda_copy.c - the plain pinned-memory H2D figure the GPU benchmarks compare with: one
 * cudaMallocHost buffer copied to one cudaMalloc buffer with cudaMemcpyAsync on a stream of
 * its own, timed over several copies after a warm-up. What a GPU's PCIe link gives, the
 * bound of any NVMe -> host -> device path.
 *
 * Not here: anything zinf does; the engine's copies are timed by the benchmarks themselves.
 */
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_copy.h"
#include "zinf_build.h"

#if ZINF_HAVE_CUDA
#include <cuda_runtime_api.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int bench_pinned_h2d(int ordinal, size_t bytes, int reps, double *gbps)
{
    void *h = NULL, *d = NULL;
    cudaStream_t s = NULL;
    int r = -EIO;
    if (bytes == 0 || reps < 1 || !gbps)
        return -EINVAL;
    if (cudaSetDevice(ordinal) != cudaSuccess || cudaMallocHost(&h, bytes) != cudaSuccess ||
        cudaMalloc(&d, bytes) != cudaSuccess ||
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
        goto out;
    /* Touch every page once, then one untimed copy: first-use costs are not the link's. */
    for (size_t i = 0; i < bytes; i += 4096)
        ((volatile char *)h)[i] = (char)i;
    if (cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s) != cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess)
        goto out;
    double t0 = now_s();
    for (int i = 0; i < reps; i++)
        if (cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s) != cudaSuccess)
            goto out;
    if (cudaStreamSynchronize(s) != cudaSuccess)
        goto out;
    *gbps = (double)bytes * reps / (now_s() - t0) / 1e9;
    r = 0;
out:
    if (s)
        cudaStreamDestroy(s);
    cudaFree(d);
    cudaFreeHost(h);
    return r;
}

#else

int bench_pinned_h2d(int ordinal, size_t bytes, int reps, double *gbps)
{
    (void)ordinal;
    (void)bytes;
    (void)reps;
    (void)gbps;
    return -ENODEV;
}

#endif
