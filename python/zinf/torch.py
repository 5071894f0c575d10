"""zinf.torch: ZeRO-Infinity for any torch.nn.Module, in one process, over a zinf engine.

    engine = zinf.Engine(config="offload.json")           # or zinf.connect(socket, job)
    model = MyModel()                                       # built as usual, in fp32
    zinf.torch.offload(model, engine, home="nvme")          # its parameters move into zinf
    opt = zinf.torch.AdamW(model.parameters(), lr=3e-4)     # torch.optim.AdamW's semantics
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()                                     # gradients go into zinf
        opt.step()                                          # AdamW on the host, streamed
        opt.zero_grad()

What happens:
- offload() registers every parameter as a zinf tensor "<prefix><name>" homed in `home`
  (with "<name>.grad" beside it), writes its values there and leaves the Parameter empty
  (0 elements); its shape is `zinf.torch.shape_of(p)`. Buffers stay where they are.
- Before a submodule's forward, a hook fetches the parameters it owns to `tier` (the device
  tier by default: the GPU's memory on a CUDA engine, host memory when the device is
  emulated) and points each Parameter's .data at the fetched copy, zero-copy over DLPack;
  after the forward (or its exception) they are released and emptied again.
- Tensors that autograd saves for the backward and that are views of a fetched parameter
  are saved as (parameter, offset, shape, strides) instead (saved_tensors_hooks), so the
  graph holds no parameter memory between forward and backward. The module's full backward
  pre-hook fetches its parameters again; a saved view asked for by a node whose module had
  no hook fetches its parameter itself.
- As autograd accumulates a parameter's gradient, a hook adds it into the "<name>.grad"
  tensor (fetched to the host tier; the first gradient after zero_grad() overwrites),
  frees torch's copy (p.grad stays None) and releases the parameter. Whatever the backward
  still holds is released when it ends.
- AdamW.zero_grad() zeroes each gradient homed on NVMe where it lies (Engine.zero): no
  byte of it is written, and the backward's first accumulation into it reads nothing from
  the drive.
- AdamW.step() fetches parameter, gradient and moments ("<name>.exp_avg", ".exp_avg_sq")
  of each parameter to the host tier, one parameter after another with the next one
  prefetched, runs libzinf's SIMD AdamW (zinf.adamw_step) on them in place, releases them
  and marks the end of the step (Engine.step), from which the engine learns the order of
  the next step's fetches for its prefetch and eviction.

The engine's tier budgets bound the memory: parameters are resident only while a module
runs or its backward needs them, gradients and moments only while stepped. Activations
are torch's. On a CUDA engine, releases wait for the current stream first (a kernel may
still read the copy), so the device copies of one module do not overlap the next module's
compute beyond what the engine prefetches.
"""

import errno
import threading

import torch

from . import Error
from . import adamw_step

__all__ = ["Offload", "AdamW", "offload", "shape_of"]

_KDLCPU, _KDLCUDA, _KDLCUDAHOST = 1, 2, 3


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def shape_of(p):
    """The shape of an offloaded parameter (its .shape reads (0,) between uses)."""
    e = getattr(p, "_zinf", None)
    return tuple(p.shape) if e is None else e.shape


def _torch_view(pin):
    """A torch tensor over a Pinned's memory, without a copy. Pinned host memory of a CUDA
    engine (kDLCUDAHost) is taken as CPU memory, which it also is."""
    dev, _ = pin.__dlpack_device__()
    if dev == _KDLCUDAHOST:
        return torch.utils.dlpack.from_dlpack(pin.__dlpack__(dl_device=(_KDLCPU, 0)))
    return torch.from_dlpack(pin)


class _Entry:
    """One offloaded parameter: its zinf tensors and who holds its fetched copy."""

    __slots__ = ("owner", "name", "param", "shape", "handle", "grad", "m", "v", "pin", "view",
                 "users", "in_backward", "has_grad")

    def __init__(self, owner, name, param, shape, handle, grad):
        self.owner, self.name, self.param, self.shape = owner, name, param, shape
        self.handle, self.grad = handle, grad
        self.m = self.v = None
        self.pin = self.view = None
        self.users = 0          # forward calls and one backward hold, each releases once
        self.in_backward = False
        self.has_grad = False   # "<name>.grad" holds a gradient since the last zero_grad


class _Saved:
    """A tensor autograd saved that was a view of a fetched parameter."""

    __slots__ = ("entry", "offset", "size", "stride")

    def __init__(self, entry, offset, size, stride):
        self.entry, self.offset, self.size, self.stride = entry, offset, size, stride


class Offload:
    """The offload of one module (module.zinf_offload); offload() makes it. remove() puts
    the parameters back."""

    def __init__(self, module, engine, *, home="nvme", tier="device", prefix="",
                 resume=False):
        if not isinstance(module, torch.nn.Module):
            raise TypeError("offload takes a torch.nn.Module")
        if tier not in ("device", "host"):
            raise ValueError(f"tier must be \"device\" or \"host\", not {tier!r}")
        self.engine, self.module, self.home, self.tier = engine, module, home, tier
        self.prefix = prefix
        self._lock = threading.RLock()
        self._entries = []
        self._by_storage = {}     # data_ptr of a fetched copy -> its entry
        self._hooks = []
        self._calls = {}          # id(submodule) -> stack of the entries each call acquired
        self._callback_queued = False
        self._cuda = None         # the torch device of fetched copies, once known
        # Fetches by the hook that asked: forward pre-hooks, full backward pre-hooks, and
        # saved views whose node came before any hook of their module (unpack).
        self.fetches = {"forward": 0, "backward": 0, "unpack": 0}
        for name, p in module.named_parameters():
            if getattr(p, "_zinf", None) is not None:
                raise ValueError(f"parameter {name} is offloaded already")
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name} is {p.dtype}; zinf.torch offloads float32")
        caps = [t["capacity_bytes"] for t in engine.stats()["tier"]]
        room = caps[0 if tier == "device" else 1]
        for mname, m in module.named_modules():
            need = sum(4 * p.numel() for p in dict.fromkeys(m.parameters(recurse=False)))
            if need > room:
                raise ValueError(f"module {mname or '(the root)'} owns {need} bytes of "
                                 f"parameters; the {tier} tier holds {room}: give it more "
                                 f"bytes, or split the module")
        for name, p in module.named_parameters():
            if 4 * p.numel() > caps[1]:
                raise ValueError(f"parameter {name} takes {4 * p.numel()} bytes; the host "
                                 f"tier holds {caps[1]}")
        originals = {}
        try:
            for name, p in module.named_parameters():
                originals[p] = p.data
                self._add(prefix + name, p, resume)
        except BaseException:
            # Undone: each parameter gets its tensor back, and what this call registered is
            # unregistered (a resumed state's tensors are left as they are saved).
            for e in self._entries:
                e.param.data = originals[e.param]
                e.param._zinf = None
                if not resume:
                    for t in (e.handle, e.grad):
                        try:
                            engine.unregister(t)
                        except Exception:
                            pass
            self._entries = []
            raise
        del originals
        owners = []
        for m in module.modules():
            own = list(dict.fromkeys(p._zinf for p in m.parameters(recurse=False)))
            if own:
                owners.append((m, own))
        for m, own in owners:
            self._hooks += [
                m.register_forward_pre_hook(self._make_pre(own)),
                m.register_forward_hook(self._post, always_call=True),
                m.register_full_backward_pre_hook(self._make_backward_pre(own)),
            ]
        for e in self._entries:
            if e.param.requires_grad:
                self._hooks.append(e.param.register_post_accumulate_grad_hook(self._grad_ready))
        forward = module.forward
        self._own_forward = module.__dict__.get("forward")  # an instance's own, put back

        def forward_with_saved_hooks(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return forward(*args, **kwargs)

        module.forward = forward_with_saved_hooks
        module.zinf_offload = self

    # ---- registration -------------------------------------------------------------------

    def _add(self, name, p, resume):
        e = self.engine
        shape = tuple(p.shape)
        if resume:
            h, g = e.lookup(name), e.lookup(name + ".grad")
            for t in (h, g):
                if t.nbytes != p.numel() * 4:
                    raise ValueError(f"{t.name} holds {t.nbytes} bytes; {name} needs "
                                     f"{p.numel() * 4}")
        else:
            h = e.register(name, (shape, "float32"), home=self.home)
            try:
                g = e.register(name + ".grad", (shape, "float32"), home=self.home)
            except BaseException:
                e.unregister(h)
                raise
        entry = _Entry(self, name, p, shape, h, g)
        self._entries.append(entry)
        if not resume:
            with e.fetch(h, "host", dirty=True) as pin:
                _torch_view(pin).copy_(p.data)
        p._zinf = entry
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _unregister_all(self):
        """Each parameter's values back into it (CPU memory), its tensors unregistered."""
        while self._entries:
            e = self._entries[0]
            e.param.data = self._read(e)
            for t in (e.handle, e.grad, e.m, e.v):
                if t is not None:
                    self.engine.unregister(t)
            e.param._zinf = None
            self._entries.pop(0)

    # ---- fetched copies -------------------------------------------------------------------

    def _view(self, pin, shape):
        v = _torch_view(pin)
        if v.dtype != torch.float32:
            v = v.view(torch.float32)
        return v.view(shape)

    def _acquire(self, entries, why):
        """One more holder of each entry's fetched copy; the ones not resident yet are
        fetched as one set (zinf_fetch_all: the tier makes room for the whole set)."""
        need = [e for e in entries if e.users == 0]
        if need:
            pins = self.engine.fetch_all([e.handle for e in need], self.tier)
            self.fetches[why] += len(need)
            try:
                views = [self._view(pin, e.shape) for pin, e in zip(pins, need)]
            except BaseException:
                for pin in pins:
                    pin.release()
                raise
            for e, pin, view in zip(need, pins, views):
                e.pin, e.view = pin, view
                self._by_storage[view.untyped_storage().data_ptr()] = e
                e.param.data = view
            if self._cuda is None:
                self._cuda = views[0].device if views[0].device.type == "cuda" else False
        for e in entries:
            e.users += 1

    def _drop(self, e):
        e.users -= 1
        if e.users:
            return
        if self._cuda:
            torch.cuda.current_stream(self._cuda).synchronize()
        self._by_storage.pop(e.view.untyped_storage().data_ptr(), None)
        e.param.data = torch.empty(0, dtype=e.view.dtype, device=e.view.device)
        e.view = None
        pin, e.pin = e.pin, None
        pin.release()

    # ---- module hooks ---------------------------------------------------------------------

    def _make_pre(self, own):
        def pre(m, args):
            with self._lock:
                got = []
                self._calls.setdefault(id(m), []).append(got)
                self._acquire(own, "forward")
                got.extend(own)

        return pre

    def _post(self, m, args, result):
        with self._lock:
            stack = self._calls.get(id(m))
            got = stack.pop() if stack else []
            for e in got:
                self._drop(e)

    def _make_backward_pre(self, own):
        def backward_pre(m, grad_output):
            with self._lock:
                self._queue_end_of_backward()
                self._hold_for_backward(own, "backward")

        return backward_pre

    def _hold_for_backward(self, entries, why):
        new = [e for e in entries if not e.in_backward]
        self._acquire(new, why)
        for e in new:
            e.in_backward = True

    def _queue_end_of_backward(self):
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def _end_of_backward(self):
        with self._lock:
            self._callback_queued = False
            for e in self._entries:
                if e.in_backward:
                    e.in_backward = False
                    self._drop(e)

    def _pack(self, t):
        try:
            e = self._by_storage.get(t.untyped_storage().data_ptr())
        except Exception:  # sparse and other storage-less tensors
            return t
        if e is None or t.dtype != torch.float32:
            return t
        return _Saved(e, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def _unpack(self, s):
        if not isinstance(s, _Saved):
            return s
        e = s.entry
        with self._lock:
            if e.view is None:
                self._queue_end_of_backward()
                self._hold_for_backward([e], "unpack")
            return torch.as_strided(e.view, s.size, s.stride, s.offset)

    def _grad_ready(self, p):
        e = p._zinf
        g = p.grad
        p.grad = None
        with self._lock:
            with self.engine.fetch(e.grad, "host", dirty=True) as pin:
                dst = self._view(pin, e.shape)
                if e.has_grad:
                    dst.add_(g.to(dst.device))
                else:
                    dst.copy_(g)
                if g.device.type == "cuda":
                    torch.cuda.current_stream(g.device).synchronize()
                del dst
            e.has_grad = True
            if e.in_backward:
                e.in_backward = False
                self._drop(e)

    # ---- the user's calls -------------------------------------------------------------------

    def _read(self, e):
        with self.engine.fetch(e.handle, "host") as pin:
            return self._view(pin, e.shape).clone()

    def state_dict(self):
        """The parameters' values, as CPU tensors (copies), by parameter name."""
        with self._lock:
            return {e.name[len(self.prefix):]: self._read(e) for e in self._entries}

    def load_state_dict(self, values):
        """Write parameter values (a name -> tensor mapping, every parameter in it)."""
        with self._lock:
            by_name = {e.name[len(self.prefix):]: e for e in self._entries}
            missing = sorted(set(by_name) - set(values))
            extra = sorted(set(values) - set(by_name))
            if missing or extra:
                raise KeyError(f"missing {missing}, unexpected {extra}")
            for k, e in by_name.items():
                if tuple(values[k].shape) != e.shape:
                    raise ValueError(f"{k}: shape {tuple(values[k].shape)}, the parameter's "
                                     f"is {e.shape}")
            for k, e in by_name.items():
                with self.engine.fetch(e.handle, "host", dirty=True) as pin:
                    self._view(pin, e.shape).copy_(values[k])

    def remove(self):
        """Take the hooks off and put each parameter's values back into it (CPU memory);
        the zinf tensors are unregistered."""
        with self._lock:
            if any(e.users for e in self._entries):
                raise RuntimeError("a forward or backward still holds parameters")
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self.module.__dict__.pop("forward", None)
            if self._own_forward is not None:
                self.module.forward = self._own_forward
            self.module.__dict__.pop("zinf_offload", None)
            self._unregister_all()


def offload(module, engine, *, home="nvme", tier="device", prefix="", resume=False):
    """Move module's parameters into engine (see the module's docstring); returns the
    Offload. home: where their permanent copies live ("nvme", "host" or "device"); tier:
    where forward and backward use them ("device" or "host"); prefix: put before each
    zinf tensor's name; resume: look the tensors up (an engine opened with resume=True)
    instead of registering and writing them."""
    return Offload(module, engine, home=home, tier=tier, prefix=prefix, resume=resume)


def _zero(engine, t):
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


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW for offloaded parameters: the same hyper-parameters, parameter
    groups and defaults, with parameter, gradient and moments streamed through the engine
    and stepped by libzinf on the host. Parameters without a gradient since zero_grad()
    are skipped, as torch skips a None .grad. The moments are zinf tensors
    "<name>.exp_avg" and "<name>.exp_avg_sq" homed with the parameter; state_dict() holds
    the step counts only. amsgrad, maximize, foreach, fused and capturable are not
    offered."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps > 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if getattr(p, "_zinf", None) is None:
                    raise ValueError("zinf.torch.AdamW steps offloaded parameters only "
                                     "(zinf.torch.offload the module first)")
        for group in self.param_groups:
            for p in group["params"]:
                e = p._zinf
                room = e.owner.engine.stats()["tier"][1]["capacity_bytes"]
                if 16 * _numel(e.shape) > room:
                    raise ValueError(f"{e.name}: its parameter, gradient and moments take "
                                     f"{16 * _numel(e.shape)} bytes; the host tier holds "
                                     f"{room}, and a step needs the four at once")
        for group in self.param_groups:
            for p in group["params"]:
                self._moments(p._zinf)

    def _moments(self, e):
        if e.m is not None:
            return
        eng = e.owner.engine
        for attr, suffix in (("m", ".exp_avg"), ("v", ".exp_avg_sq")):
            name = e.name + suffix
            try:
                t = eng.lookup(name)
            except Error:
                t = eng.register(name, (e.shape, "float32"), home=e.owner.home)
            setattr(e, attr, t)

    def zero_grad(self, set_to_none=True):
        """set_to_none (the default): the gradients are forgotten, and a parameter that gets
        none before the next step is skipped by it. False: they are zeros, so that the next
        step moves every parameter, as torch's does. Either way a gradient homed on NVMe
        becomes zeros where it lies, without a byte moved (Engine.zero), so that the next
        backward does not read it back to overwrite it; one homed in memory is written as
        zeros (False) or left as it is (the default: the next backward overwrites it)."""
        for group in self.param_groups:
            for p in group["params"]:
                e = p._zinf
                with e.owner._lock:
                    zeroed = (e.has_grad or not set_to_none) and _zero(e.owner.engine, e.grad)
                    if not set_to_none and not zeroed:
                        with e.owner.engine.fetch(e.grad, "host", dirty=True) as pin:
                            _torch_view(pin).zero_()
                    e.has_grad = not set_to_none
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, p) for group in self.param_groups for p in group["params"]
                if p._zinf.has_grad]
        for i, (group, p) in enumerate(work):
            e = p._zinf
            eng = e.owner.engine
            if i + 1 < len(work):
                n = work[i + 1][1]._zinf
                for t in (n.handle, n.grad, n.m, n.v):
                    eng.prefetch(t, "host")
            st = self.state[p]
            st["step"] = st.get("step", 0) + 1
            b1, b2 = group["betas"]
            with e.owner._lock:
                pins = eng.fetch_all([e.handle, e.grad, e.m, e.v], "host", dirty=True)
                try:
                    adamw_step(*pins, st["step"], group["lr"], b1, b2, group["eps"],
                               group["weight_decay"])
                finally:
                    for pin, dirty in zip(pins, (True, False, True, True)):
                        pin.release(dirty=dirty)
        engines = {id(p._zinf.owner.engine): p._zinf.owner.engine
                   for group in self.param_groups for p in group["params"]}
        for eng in engines.values():
            eng.step()
        return loss
