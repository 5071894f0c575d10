"""init(): a model built straight into zinf, one module's parameters in memory at a time."""

import contextlib
import threading
import weakref

import torch

from ._offload import Offload, _set_data, gathered
from ._param import OffloadedError

__all__ = ["init"]

_disabled = torch._C.DisableTorchFunctionSubclass
_lock = threading.Lock()


def _is_hf(m):
    for c in type(m).__mro__:
        if c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers"):
            return True
    return False


class _Build:
    """What init() saw while the model was built."""

    def __init__(self):
        self.params = weakref.WeakKeyDictionary()   # module -> its parameters made meta
        self.values = {}          # id(meta parameter) -> (the parameter, its values)


@contextlib.contextmanager
def init(engine, *, dtype=None, **offload_args):
    """Build a model straight into zinf:

        with zinf.torch.init(engine, home="nvme"):
            model = LlamaForCausalLM(config)        # or any nn.Module

    Each parameter is made on the meta device as the module registers it (as accelerate's
    init_empty_weights does: no memory, no initialisation), buffers are made as usual.
    When the block ends, every model built in it (a module created in the block that is no
    other's submodule) is offloaded as zinf.torch.offload(model, engine, **offload_args)
    would, and its parameters are initialised module after module, children first, each
    module's written into zinf before the next one's are made: reset_parameters() where
    the module has one (torch's layers), else the values the parameter had when it was
    registered (kept in memory until then: a norm's ones); then, for a Hugging Face model,
    its own _init_weights, as from_config() would. So the peak memory is the largest
    module's parameters, not the model's. dtype: the default dtype while the block runs
    (torch.bfloat16: a bf16 model). A module without reset_parameters whose parameter was
    made on the meta device already has no values to take: that is an error that names it.
    """
    build = _Build()
    real_register = torch.nn.Module.register_parameter

    def register_parameter(module, name, param):
        real_register(module, name, param)
        p = module._parameters.get(name)
        if p is None or p.is_meta or p.__dict__.get("_zinf") is not None:
            if p is not None and p.is_meta:
                build.params.setdefault(module, {})[name] = p
            return
        meta = type(p)(p.detach().to("meta"), requires_grad=p.requires_grad) \
            if type(p) is not torch.nn.Parameter else \
            torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
        if not callable(getattr(module, "reset_parameters", None)):
            build.values[id(meta)] = (meta, p.detach())
        module._parameters[name] = meta
        build.params.setdefault(module, {})[name] = meta

    parents = weakref.WeakKeyDictionary()         # module -> the module it was put in

    def on_submodule(module, name, sub):
        if sub is not None:
            parents[sub] = module

    old_dtype = torch.get_default_dtype()
    with _lock:
        torch.nn.Module.register_parameter = register_parameter
        handle = torch.nn.modules.module.register_module_module_registration_hook(on_submodule)
        try:
            if dtype is not None:
                torch.set_default_dtype(dtype)
            yield
        finally:
            handle.remove()
            torch.nn.Module.register_parameter = real_register
            torch.set_default_dtype(old_dtype)
    # The models built: walk up from each module that made parameters to the outermost one
    # that holds it still (a module put in a container and dropped again holds nothing).
    roots = {}
    for m in list(build.params.keys()):
        top = m
        while top in parents and any(c is top for c in parents[top].children()):
            top = parents[top]
        roots[id(top)] = top
    for root in roots.values():
        _materialize(root, engine, build, offload_args)


def _post_order(m, out):
    for c in m.children():
        _post_order(c, out)
    out.append(m)
    return out


def _hf_owner(root):
    """module -> the Hugging Face model whose _init_weights initialises it (the nearest
    PreTrainedModel above it, as transformers' own smart_apply dispatches)."""
    owner = {}

    def walk(m, cur):
        if _is_hf(m):
            cur = m
        owner[id(m)] = cur
        for c in m.children():
            walk(c, cur)

    walk(root, None)
    return owner


def _materialize(root, engine, build, offload_args):
    # Each meta parameter becomes an empty CPU Parameter (every alias of it), with its shape
    # kept for the offload, which registers it without values.
    fresh, shapes = {}, {}
    for m in root.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in fresh:
                q = torch.nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
                fresh[id(p)] = (p, q)
                shapes[q] = tuple(p.shape)
            m._parameters[name] = fresh[id(p)][1]
    for m in root.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                raise ValueError(f"zinf.torch.init: buffer {name} of {type(m).__name__} was "
                                 f"made on the meta device; make buffers outside a meta "
                                 f"device context")
    off = Offload(root, engine, _shapes=shapes, **offload_args)
    owner = _hf_owner(root)
    metas = {id(q): p for p, q in fresh.values()}   # the new parameter -> the meta one
    done = set()
    try:
        for m in _post_order(root, []):
            own = [p for p in dict.fromkeys(m._parameters.values())
                   if p is not None and p.__dict__.get("_zinf") is not None
                   and p.__dict__["_zinf"].owner is off and id(p) not in done]
            entries = [p._zinf for p in own]
            extra = []    # parameters of other modules that the module's init writes
            while True:
                try:
                    with gathered([e.param for e in extra], modify=True):
                        _init_module(m, off, entries, owner.get(id(m)), build, metas)
                    break
                except OffloadedError as err:
                    if err.entry is None or err.entry in extra or err.entry.owner is not off:
                        raise
                    extra.append(err.entry)
            done.update(id(p) for p in own)
    except BaseException:
        off.discard()
        raise
    build.values.clear()
    return off


def _init_module(m, off, entries, hf, build, metas):
    """m's own parameters made, initialised and written into zinf (its buffers too, by a
    Hugging Face model's init: rotary frequencies)."""
    with torch.no_grad():
        for e in entries:
            e.view = torch.empty(e.shape, dtype=e.dtype)
            _set_data(e.param, e.view)
        try:
            if entries and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
            else:
                for e in entries:
                    meta = metas.get(id(e.param))
                    got = build.values.get(id(meta)) if meta is not None else None
                    if got is None and hf is None:
                        raise ValueError(
                            f"zinf.torch.init: parameter {e.name} of {type(m).__name__} has "
                            f"no values to take (made on the meta device, and the module "
                            f"has no reset_parameters)")
                    if got is not None:
                        e.view.copy_(got[1])
            if hf is not None:
                _hf_init(hf, m)
            for e in entries:
                off.write(e, e.view)
        finally:
            for e in entries:
                e.view = None
                _set_data(e.param, torch.empty(0, dtype=e.dtype))


def _hf_init(hf, m):
    m.__dict__.pop("_is_hf_initialized", None)   # set while it was built on meta
    with torch.no_grad():
        f = getattr(hf, "_initialize_weights", None)
        if f is not None:
            f(m)
        else:
            hf._init_weights(m)
