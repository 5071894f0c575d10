"""zinf.torch's small pieces over zinf's pinned copies: dtypes, sizes, views, zeroing."""

import errno

import torch

from .. import Error

_KDLCPU, _KDLCUDAHOST = 1, 3
_disabled = torch._C.DisableTorchFunctionSubclass
_from_capsule = torch._C._from_dlpack

# The parameter dtypes zinf.torch offloads, by zinf's name for them.
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Their codes for _grad_add, which adds a gradient of each into the float32 one in zinf.
_GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def page_round(nbytes):
    """nbytes as a tier places them: in whole 4 KiB pages."""
    return (nbytes + 4095) // 4096 * 4096


def shape_of(p):
    """The shape of a parameter, offloaded or not (an offloaded one reads (0,) between
    uses)."""
    e = p.__dict__.get("_zinf")
    return tuple(p.shape) if e is None else e.shape


def torch_view(pin):
    """A torch tensor over a Pinned's memory, without a copy. Plain CPU memory (the host
    tier, the emulated device) is taken straight from the DLPack capsule; pinned host
    memory of a CUDA engine (kDLCUDAHost) as CPU memory, which it also is; the rest through
    torch.from_dlpack."""
    dev = pin.__dlpack_device__()[0]
    if dev == _KDLCPU:
        return _from_capsule(pin.__dlpack__())
    if dev == _KDLCUDAHOST:
        return _from_capsule(pin.__dlpack__(dl_device=(_KDLCPU, 0)))
    return torch.from_dlpack(pin)


def view_as(pin, shape, dtype):
    """torch_view(pin) as dtype and shape (a tensor registered with them already is)."""
    v = torch_view(pin)
    if v.dtype != dtype:
        v = v.view(dtype)
    if v.shape != shape:
        v = v.view(shape)
    return v


def zero(engine, t):
    """Engine.zero(t) where zinf takes it (homed on NVMe, nobody holding it): True; False
    where it does not (a home in memory, a pin another thread holds), for the caller to
    zero it by hand if it must."""
    try:
        engine.zero(t)
        return True
    except Error as err:
        if err.errno in (errno.EINVAL, errno.EBUSY):
            return False
        raise


def _grad_of(p):
    with _disabled():
        return p.grad


def _set_grad(p, g):
    with _disabled():
        p.grad = g


def _set_data(p, v):
    with _disabled():
        p.data = v
