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

Buffers. A Pinned is also a buffer of its bytes (memoryview(p), numpy.frombuffer(p,
dtype), bytes(p)): 1-D unsigned bytes, readable always, writable only where it was fetched
with dirty=True (a writable buffer of a clean pin, or of a read-only engine's, raises
BufferError saying why). A buffer keeps the Pinned alive, but unlike a DLPack view it is
never waited for: release() while one is alive raises BufferError and keeps the pin, so
release the memoryview (or delete the array) first. A copy in GPU memory has no buffer
(BufferError): take it through DLPack.

An NVMe home (register's default) needs an NVMe tier: an Engine opened without nvme_path
(or from a config without zero_optimization.offload_param.nvme_path) refuses it with
zinf.Error(EINVAL) naming the setting.

Refused releases. Where zinf refuses a release's flags it keeps the pin, and so does the
Pinned: release(dirty=True) while the tensor's copy in the other tier is pinned (EBUSY),
release(dirty=True) or release(spent=True) on a read-only engine (EROFS, raised at once
even with views alive), release(spent=True) while another holds the tensor (EBUSY) or for
a tensor homed in memory (EINVAL). The Pinned stays unreleased and release() may be called
again; after a refused dirty release its default is dirty. When the last view's deleter
makes the release: a refused spent release goes clean (the content stays), a refused dirty
one keeps the pin, with a RuntimeWarning, and the Pinned is held again (release() it once
the other pin is gone). A Pinned collected with such a dirty release still refused leaves
its pin to the engine, which releases it dirty as soon as another of its pins goes (at the
latest when it closes), so what was written through it is never dropped for a clean
release.

Saved states. Leaving an Engine's with-block normally closes it with a flush; leaving it
by an exception closes it with close_unflushed(): the last flush stays the saved state,
so an update interrupted half way never replaces it with a torn one. flush(step=,
keep_previous=) tags the state and keeps the one it replaces (Engine(previous=True) opens
it; drop_previous() forgets it); zinf.saved_steps(dir), saved_at(dir) and
saved_tensors(dir) read a swap directory's manifests without opening an engine.

Waiting for room. fetch(..., wait=) and fetch_all(..., wait=): where zinf answers ENOMEM
(the tier is full of copies other threads hold pinned), wait=<seconds> or wait=True (no
limit) waits, the GIL released, until a pin of this Engine is released in this process,
and tries again, until it fits or the time runs out (then zinf.Error(ENOMEM) names the
wait). A tensor or set larger than the tier, or a tier whose room no pin holds (homes
fill it), fails at once all the same. Pins the waiting thread holds itself are not
released while it waits: a thread that waits for room holding pins of the tier may wait
for ever (wait=True). Closing the engine wakes the waiters (ValueError). The default,
wait=None, fails at once.

Forks. A child of os.fork() cannot use an Engine its parent opened (nor its Pinned
objects): every call raises RuntimeError ("opened in another process"), close() only
forgets it, and collecting it, its Pinned objects or its views in the child touches
nothing (no close, flush or release: the engine, its threads and its files are the
parent's, which carries on unaffected). Open a new Engine in the child.

adamw_step takes float32 only: a Pinned of a tensor registered with another dtype, or an
array or buffer of another type (float64, float16, bfloat16, int32, uint8 arrays...), is a
TypeError that names the argument and its type. Bytes that carry no type are taken as
float32: a Pinned of a tensor registered by size alone (or resumed: a saved run keeps no
dtype), and plain bytes, bytearray or memoryview buffers of unsigned bytes.

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
    saved_at,
    saved_steps,
    saved_tensors,
    set_log,
    strerror,
)

__all__ = [
    "DEVICE", "HOST", "NVME", "Engine", "Error", "Pinned", "Tensor", "__version__",
    "adamw_step", "connect", "saved_at", "saved_steps", "saved_tensors", "set_log",
    "strerror",
]
