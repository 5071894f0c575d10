/*
 * cuda_probe.c - asks the CUDA runtime whether a usable GPU is present. A machine with
 * the toolkit but no driver (or no device) answers "none" here, never a crash. Built
 * without CUDA, it answers "none" too, so callers carry no #ifdef.
 */
#include <errno.h>
#include <stdio.h>

#include "common.h"
#include "tiers/cuda_probe.h"

#if ZINF_HAVE_CUDA
#include <cuda_runtime_api.h>

int cuda_probe(struct cuda_probe_info *out)
{
    int n = 0, drv = 0, rt = 0;
    cudaError_t e;

    *out = (struct cuda_probe_info){0};
    cudaRuntimeGetVersion(&rt);
    out->runtime_version = rt;
    e = cudaDriverGetVersion(&drv);
    out->driver_version = e == cudaSuccess ? drv : 0;
    e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        /* In words a user can act on; the runtime's own string otherwise. */
        if (e == cudaErrorInsufficientDriver && drv == 0)
            snprintf(out->reason, sizeof(out->reason), "no NVIDIA driver is installed");
        else if (e == cudaErrorInsufficientDriver)
            snprintf(out->reason, sizeof(out->reason),
                     "driver older than the CUDA runtime (driver CUDA %d.%d, runtime %d.%d)",
                     drv / 1000, drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
        else if (e == cudaErrorNoDevice)
            snprintf(out->reason, sizeof(out->reason), "no CUDA device");
        else
            snprintf(out->reason, sizeof(out->reason), "%s", cudaGetErrorString(e));
        cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
        return 0;
    }
    out->device_count = n;
    if (n > 0) {
        struct cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, 0) == cudaSuccess) {
            snprintf(out->name, sizeof(out->name), "%s", p.name);
            out->total_bytes = p.totalGlobalMem;
        }
    } else {
        snprintf(out->reason, sizeof(out->reason), "no CUDA device");
    }
    return n;
}

int cuda_pci_busid(int ordinal, char *buf, size_t len)
{
    struct cuda_probe_info ci;
    if (ordinal < 0 || ordinal >= cuda_probe(&ci))
        return -ENODEV;
    if (cudaDeviceGetPCIBusId(buf, (int)len, ordinal) != cudaSuccess) {
        cudaGetLastError();
        return -ENODEV;
    }
    return 0;
}
#else
int cuda_pci_busid(int ordinal, char *buf, size_t len)
{
    return -ENODEV;
}

int cuda_probe(struct cuda_probe_info *out)
{
    *out = (struct cuda_probe_info){0};
    snprintf(out->reason, sizeof(out->reason), "built without CUDA");
    return 0;
}
#endif
