/* cuda_probe.h - is a usable CUDA GPU present? (See cuda_probe.c.) */
#ifndef ZINF_CUDA_PROBE_H
#define ZINF_CUDA_PROBE_H
#include <stddef.h>

struct cuda_probe_info {
    int device_count;
    int runtime_version, driver_version; /* 1000*major + 10*minor; 0 when unknown */
    size_t total_bytes;                  /* of device 0 */
    char name[256];                      /* of device 0 */
    char reason[128];                    /* why there is none */
};

/* Returns the number of usable devices (0 when none, for whatever reason). */
int cuda_probe(struct cuda_probe_info *out);
/* The PCI bus id ("0000:17:00.0") of CUDA device ordinal: 0, or -ENODEV when there is no
 * such usable device (or no CUDA in this build). */
int cuda_pci_busid(int ordinal, char *buf, size_t len);
#endif
