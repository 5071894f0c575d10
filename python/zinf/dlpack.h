/*
 * dlpack.h - the DLPack structures the zinf Python extension exports tensors with, written
 * from the DLPack 1.x specification (the versioned managed tensor with its flags, and the
 * legacy one for consumers that ask for no version). Only what a producer needs is here:
 * this is not the full upstream header.
 */
#ifndef ZINF_DLPACK_H
#define ZINF_DLPACK_H

#include <stdint.h>

#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 0

/* The consumer must not write through a tensor with this flag. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0)
/* The producer copied the data for this export (zinf never does: its exports are views). */
#define DLPACK_FLAG_BITMASK_IS_COPIED (UINT64_C(1) << 1)

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3, /* host memory registered with (pinned for) CUDA */
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6,
} DLDataTypeCode;

typedef struct {
    uint8_t code;   /* DLDataTypeCode */
    uint8_t bits;   /* of one lane */
    uint16_t lanes; /* 1 for scalars */
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;   /* ndim elements */
    int64_t *strides; /* in elements; NULL: compact row-major */
    uint64_t byte_offset;
} DLTensor;

/* The legacy form, the capsule named "dltensor". */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* The 1.x form, the capsule named "dltensor_versioned". */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#endif /* ZINF_DLPACK_H */
