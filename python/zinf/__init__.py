"""zinf: tensors kept in a device (GPU) <-> pinned host <-> NVMe hierarchy, from Python.

A thin layer over libzinf (include/zinf.h): every call maps to one C call, drops the GIL
while it may block, and raises zinf.Error (an OSError whose .errno is the positive errno
and whose message is zinf's) when the C call fails. Bad Python arguments raise TypeError
or ValueError. One Engine may be used from several threads at once.

    with zinf.Engine(nvme_path="/scratch/swap", device="emulated") as e:
        t = e.register("w", ((1024, 1024), "float32"), home="nvme")
        with e.fetch(t, "host", dirty=True) as p:
            a = numpy.from_dlpack(p)   # a view of the pinned copy: no bytes are copied
            a[:] = 1.0
        e.flush()

Pins and views. Engine.fetch returns a Pinned: the copy stays resident and unmoved at
.ptr until it is released (release(), the end of its with-block, or the object being
collected). A DLPack view taken from it (numpy.from_dlpack, torch.from_dlpack, ...) keeps
the pin for itself: after release() the pin is held on until the consumer deletes the
last view, so a view used after the with-block still points at valid memory (and
unregistering the tensor answers EBUSY meanwhile). The release then happens with the
flags release() was given: write through a view before releasing it dirty, not after.
Engine.close() refuses new calls at once and closes the engine when no pin or view is
left.

DLPack devices: the device tier of a CUDA engine is kDLCUDA; its pinned host tier is
kDLCUDAHost; the emulated device tier and plain host memory are kDLCPU. A tensor
registered with (shape, dtype) is exported with them, others as 1-D uint8 of its bytes.

This package does not move data between devices, copy on export, or know of torch.
"""

from ._zinf import (  # noqa: F401  (re-exports)
    DEVICE,
    HOST,
    NVME,
    Engine,
    Error,
    Pinned,
    Tensor,
    __version__,
    adamw_step,
    connect,
    strerror,
)

__all__ = [
    "DEVICE", "HOST", "NVME", "Engine", "Error", "Pinned", "Tensor", "__version__",
    "adamw_step", "connect", "strerror",
]
