/*
 * zinf.h - the public interface of zinf, a memory-tiering and offload engine that keeps
 * tensors in a device (GPU) <-> pinned host <-> NVMe hierarchy.
 *
 * Every function that returns int returns 0 (or a count) on success and a negative errno
 * on failure; errno is never the channel. This header is self-contained and C99/C++ clean.
 * It is not the internal API: the IO engine and swap space below it are not exported.
 */
#ifndef ZINF_H
#define ZINF_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define ZINF_API __attribute__((visibility("default")))
#else
#define ZINF_API
#endif

#define ZINF_VERSION_MAJOR 0
#define ZINF_VERSION_MINOR 1
#define ZINF_VERSION_PATCH 0

typedef struct zinf_engine zinf_engine;
typedef uint64_t zinf_tensor; /* 0 is never a valid handle */

enum zinf_tier { ZINF_TIER_DEVICE, ZINF_TIER_HOST, ZINF_TIER_NVME };
enum zinf_device_kind { ZINF_DEVICE_AUTO, ZINF_DEVICE_CUDA, ZINF_DEVICE_EMULATED };

/* zinf_options.flags */
#define ZINF_OPEN_RESUME (1u << 0) /* reopen tensors persisted in nvme_path */

struct zinf_options {        /* zero-initialised = defaults */
    const char *nvme_path;   /* directory for swap files; NULL: no NVMe tier */
    size_t device_bytes;     /* device tier capacity; 0: default */
    size_t host_bytes;       /* pinned host tier capacity; 0: default */
    size_t block_size;       /* bytes per IO request; 0: 1 MiB */
    unsigned queue_depth;    /* IO requests in flight; 0: 32 */
    enum zinf_device_kind device_kind; /* AUTO: CUDA if a GPU is usable, else emulated */
    int cuda_device;         /* CUDA ordinal when CUDA is used */
    unsigned flags;          /* ZINF_OPEN_RESUME */
    /* Extra swap directories (one per drive); extents are striped over nvme_path and
     * these in block_size units. NULL-terminated; NULL: nvme_path alone. */
    const char *const *nvme_paths_extra;
    uint64_t reserved[8];    /* must be zero */
};

/* The library's version as "MAJOR.MINOR.PATCH". */
ZINF_API const char *zinf_version(void);

/* A message for a negative errno returned by zinf (or any errno); never NULL. */
ZINF_API const char *zinf_strerror(int err);

#ifdef __cplusplus
}
#endif
#endif /* ZINF_H */
