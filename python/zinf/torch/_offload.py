"""offload(): a module's parameters moved into zinf, fetched around each use by hooks."""

import collections
import contextlib
import copy
import functools
import threading
import weakref

import torch

from .. import Error
from . import _ddp as ddp
from ._dist import make_group
from ._grads import GradsMixin
from ._param import GradProxy, OffloadedError, param_class
from ._zero3 import BUCKET_BYTES, Zero3
from ._views import (DTYPES, _disabled, _grad_of, _numel, _set_data, _set_grad, page_round,
                     shape_of, view_as)

__all__ = ["Offload", "offload", "gathered", "shape_of", "DTYPES"]

_push_saved = torch._C._autograd._push_saved_tensors_default_hooks
_pop_saved = torch._C._autograd._pop_saved_tensors_default_hooks


def _saved_hooks_free():
    """No saved-tensor hooks are on, and they may be pushed."""
    a = torch._C._autograd
    return a._saved_tensors_hooks_is_enabled() and a._top_saved_tensors_default_hooks(False) is None

def _in_backward():
    return torch._C._current_graph_task_id() != -1


class _Entry:
    """One offloaded parameter: its zinf tensors, who holds its fetched copy, and the state
    of its gradient in zinf.

    Its states, and what moves it between them (check() holds the invariants):
    - idle: users 0, no pin, no view; p.data is empty and p a ZinfParameter; p.grad is the
      GradProxy where has_grad, else None.
    - fetched (users > 0: forward calls, a gather, a load, and on a GPU one hold of the
      backward's, in_backward): pin and view set, p.data the view, p a plain Parameter.
      _acquire: idle -> fetched; _drop of the last user: fetched -> idle.
    - standing (the backward, between _grad_pre and _grad_ready): idle but p.data the
      stand-in (p's shape, no memory) and p.grad torch's own; _grad_ready or the backward's
      end (or release_stale after an exception) -> idle. A fetch meanwhile (a gather from
      another thread) leaves p.grad alone, and its _drop puts the stand-in back; where
      _grad_ready finds it fetched, standing ends and the last _drop puts the proxy.
    - pending (any of the above but standing): AdamW(overlap=True).step() left its update
      to its next use; ensure() carries it out before anything reads or overwrites what it
      touches -> not pending. zero_later: a zero_grad() came after the step, its zeros
      written once the update has read the gradient (pending only).
    A saved view the backward unpacked holds its own pin (Offload._unpacked), not a user."""

    __slots__ = ("owner", "name", "param", "shape", "dtype", "cls", "handle", "grad", "m",
                 "v", "vmax", "master", "pin", "view", "users", "in_backward", "dirty",
                 "hooked", "has_grad", "fresh", "proxy", "gnorm", "gscale", "nonfinite",
                 "zcls", "ordered", "empty", "standin", "standing", "pending", "zero_later",
                 "sshape")

    def __init__(self, owner, name, param, handle, grad):
        self.owner, self.name, self.param = owner, name, param
        self.shape, self.dtype, self.cls = tuple(param.shape), param.dtype, type(param)
        self.sshape = self.shape    # the shape of its tensors in zinf (stage 3: a slice's)
        self.zcls = param_class(self.cls)
        self.ordered = False    # in the Offload's _order, the order of first use
        self.empty = None       # what p.data is between uses (set at the first fetch)
        # In the backward, between the gradient's pre-hook and its post-accumulate hook, p.data
        # is standin (standing): a tensor of p's shape and no memory (one NaN, broadcast),
        # enough for AccumulateGrad, which checks the shape and reads no value.
        self.standin = None
        self.standing = False
        # An update AdamW(overlap=True).step() deferred to the parameter's next use:
        # (optimizer, its arguments); zero_later: a zero_grad() that came after it, done
        # once the update has read the gradient.
        self.pending = None
        self.zero_later = False
        self.handle, self.grad = handle, grad
        self.m = self.v = self.vmax = self.master = None
        self.pin = self.view = None
        self.users = 0          # forward calls, one backward hold and gathers
        self.in_backward = False
        self.dirty = False      # a holder writes through the copy: released dirty
        self.hooked = False     # the post-accumulate-grad hook is on
        # The gradient: has_grad, p.grad exists (torch skips a parameter without one);
        # fresh, the next accumulation overwrites what zinf holds; gscale, a factor not yet
        # applied to it; gnorm, its 2-norm (scaled); nonfinite, an inf or nan in it.
        self.has_grad = False
        self.fresh = True
        self.proxy = None
        self.gnorm = None
        self.gscale = 1.0
        self.nonfinite = False

    def check(self):
        """The invariants of the states above, broken ones as strings (none: [])."""
        bad = []
        if (self.users == 0) != (self.pin is None) or (self.pin is None) != (self.view is None):
            bad.append(f"users {self.users} with pin {self.pin is not None} and view "
                       f"{self.view is not None}")
        if self.in_backward and self.users == 0:
            bad.append("held by the backward without a user")
        if self.standing and not self.hooked:
            bad.append("standing without its gradient's hooks")
        if self.zero_later and self.pending is None:
            bad.append("zeros left for an update that is not pending")
        if self.pending is not None and (self.m is None or self.v is None):
            bad.append("pending without its moments")
        if self.users == 0 and not self.standing and type(self.param) is not self.zcls:
            bad.append(f"idle as {type(self.param).__name__}")
        return [f"{self.name}: {b}" for b in bad]

    @property
    def nbytes(self):
        return _numel(self.shape) * self.dtype.itemsize


class _Saved:
    """A tensor autograd saved that was a view of a fetched parameter."""

    __slots__ = ("entry", "offset", "size", "stride")

    def __init__(self, entry, offset, size, stride):
        self.entry, self.offset, self.size, self.stride = entry, offset, size, stride


class Offload(GradsMixin):
    """The offload of one module (module.zinf_offload); offload() makes it. remove() puts
    the parameters back."""

    def __init__(self, module, engine, *, home="nvme", tier="device", prefix="",
                 resume=False, wait=30.0, group=None, stage=None,
                 bucket_bytes=BUCKET_BYTES, _shapes=None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError("offload takes a torch.nn.Module")
        # Across ranks: the group the gradients are averaged over (None: this process
        # alone); _unreduced, a backward accumulated into them since the last reduction.
        self.dist = make_group(group, stage, bucket_bytes)
        self._unreduced = False
        # Stage 3: the slices' layout, gathers and the backward's buckets (_zero3.py).
        self.z3 = Zero3(self.dist, bucket_bytes) if self.dist and self.dist.stage == 3 \
            else None
        if tier not in ("device", "host"):
            raise ValueError(f"tier must be \"device\" or \"host\", not {tier!r}")
        self.engine, self.module, self.home, self.tier = engine, module, home, tier
        self.prefix = prefix
        self._lock = threading.RLock()
        self._entries = []
        self._by_storage = {}     # data_ptr of a fetched copy -> its entry
        self._hooks = []
        self._calls = {}          # id(submodule) -> stack of (entries acquired, hooks pushed)
        self._tls = threading.local()   # .depth: forwards with zinf's saved-tensor hooks on
        self._loading = []        # entries load_state_dict holds between its two hooks
        self._unpacked = []       # pins of saved views the backward unpacked (each goes
                                  # with its view)
        self._callback_queued = False
        self._cuda = None         # the torch device of fetched copies, once known
        self._sd_cache = (None, {})
        self._shapes = _shapes or {}   # parameters made under init(): their shapes, no values
        self._fetch_kw = {"wait": wait} if wait else {}
        self._empties = {}        # (dtype, device) -> the 0-element tensor of idle parameters
        self._order = []          # entries in the order the forward (or anyone) first fetched them
        # Fetches by who asked: forward pre-hooks, saved views of parameters that the
        # backward unpacked (unpack), and gathers.
        self.fetches = {"forward": 0, "unpack": 0, "gather": 0}
        named = list(module.named_parameters())
        for name, p in named:
            if p.__dict__.get("_zinf") is not None:
                raise ValueError(f"parameter {name} is offloaded already")
            if p.dtype not in DTYPES:
                raise TypeError(f"parameter {name} is {p.dtype}; zinf.torch offloads "
                                f"{', '.join(str(d) for d in DTYPES)}")
        caps = [t["capacity_bytes"] for t in engine.stats()["tier"]]
        room = caps[0 if tier == "device" else 1]
        self._tier_room = room
        for mname, m in module.named_modules():
            need = sum(page_round(self._numel(p) * p.element_size())
                       for p in dict.fromkeys(m.parameters(recurse=False)))
            if need > room:
                raise ValueError(f"module {mname or '(the root)'} owns {need} bytes of "
                                 f"parameters; the {tier} tier holds {room}: give it more "
                                 f"bytes, or split the module")
        for name, p in named:
            if page_round(4 * self._numel(p)) > caps[1]:
                raise ValueError(f"parameter {name} takes {4 * self._numel(p)} bytes as float32 "
                                 f"(its gradient); the host tier holds {caps[1]}")
        if self.z3 is not None and not self._shapes and not resume:
            # Before the slicing: gathered, every rank's values would be the same.
            self.dist.check_same((prefix + name, tuple(p.shape), lambda p=p: p.data)
                                 for name, p in named)
        originals = {}
        try:
            for name, p in named:
                originals[p] = p.data
                self._add(prefix + name, p, resume)
        except BaseException:
            # Undone: each parameter gets its tensor back, and what this call registered is
            # unregistered (a resumed state's tensors are left as they are saved).
            for e in self._entries:
                _set_data(e.param, originals[e.param])
                e.param.__class__ = e.cls
                del e.param.__dict__["_zinf"]
                if not resume:
                    try:
                        engine.unregister(e.handle)
                    except Exception:
                        pass
            self._entries = []
            raise
        del originals
        self._install_hooks()
        if self.dist is not None and self.z3 is None and not self._shapes:
            try:
                self.dist.check_same((e.name, e.shape, functools.partial(self.read, e))
                                     for e in self._entries)
            except BaseException:
                self.remove()
                raise

    # ---- registration -------------------------------------------------------------------

    def _numel(self, p):
        return _numel(self._shapes[p]) if p in self._shapes else p.numel()

    def _add(self, name, p, resume):
        e = self.engine
        shape, dt = tuple(p.shape), DTYPES[p.dtype]
        shape = self._shapes.get(p, shape)
        n = _numel(shape)
        sshape = (self.z3.slice_len(shape),) if self.z3 is not None else shape
        if self.z3 is not None:
            n = sshape[0]
        if resume:
            h = e.lookup(name)
            try:
                g = e.lookup(name + ".grad")
            except Error:
                g = None
            for t, want in ((h, n * p.element_size()), (g, n * 4)):
                if t is not None and t.nbytes != want:
                    raise ValueError(f"{t.name} holds {t.nbytes} bytes; {name} needs {want}")
        else:
            h = e.register(name, (sshape, dt), home=self.home)
            g = None      # "<name>.grad" is registered by the first gradient
        entry = _Entry(self, name, p, h, g)
        entry.shape, entry.sshape = shape, sshape
        self._entries.append(entry)
        if not resume and p not in self._shapes:
            with e.fetch(h, "host", dirty=True) as pin:
                with _disabled():
                    view_as(pin, sshape, p.dtype).copy_(
                        self.z3.slice_of(p.data, entry) if self.z3 else p.data)
        p.__dict__["_zinf"] = entry
        p.__class__ = param_class(entry.cls)
        _set_data(p, torch.empty(0, dtype=p.dtype, device=p.device))

    def grad_handle(self, e):
        """e's "<name>.grad", registered (or found, resumed) when first needed: a frozen
        parameter never has one."""
        if e.grad is None:
            try:
                e.grad = self.engine.lookup(e.name + ".grad")
            except Error:
                e.grad = self.engine.register(e.name + ".grad", (e.sshape, "float32"),
                                              home=self.home)
        return e.grad

    def _install_hooks(self):
        module = self.module
        owners = []
        for m in module.modules():
            own = list(dict.fromkeys(p._zinf for p in m.parameters(recurse=False)))
            if own:
                owners.append((m, own))
        if not owners or owners[0][0] is not module:
            self._hooks.append(module.register_forward_pre_hook(self._root_pre))
        for m, own in owners:
            self._hooks += [
                m.register_forward_pre_hook(self._make_pre(own, m is module)),
                m.register_forward_hook(self._make_post(own), always_call=True),
                m.register_state_dict_post_hook(
                    lambda m, sd, prefix, md: self._state_dict_hook(m, sd, prefix, md)),
                m.register_load_state_dict_pre_hook(self._load_pre),
                m.register_load_state_dict_post_hook(self._load_post),
            ]
        for e in self._entries:
            self._hook_grad(e)
        forward = module.forward
        self._own_forward = module.__dict__.get("forward")  # an instance's own, put back

        @functools.wraps(forward)   # its signature: HF's Trainer picks the inputs by it
        def forward_with_saved_hooks(*args, **kwargs):
            tls = self._tls
            depth = getattr(tls, "depth", 0)
            tls.depth = depth + 1
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    return forward(*args, **kwargs)
            finally:
                tls.depth = depth

        module.forward = forward_with_saved_hooks
        module.__dict__["zinf_offload"] = self
        module.__dict__["__deepcopy__"] = self._deepcopy
        module.__dict__["__reduce_ex__"] = self._reduce_ex
        module.__dict__[ddp.KEY] = ddp.NoDDP(self.dist is not None)

    def _hook_grad(self, e):
        if not e.hooked and e.param.requires_grad:
            self._hooks.append(e.param.register_hook(functools.partial(self._grad_pre, e)))
            self._hooks.append(e.param.register_post_accumulate_grad_hook(self._grad_ready))
            e.hooked = True

    def _unregister_all(self):
        """Each parameter's values back into it (CPU memory), its tensors unregistered."""
        while self._entries:
            e = self._entries[0]
            _set_data(e.param, self.read(e))
            for t in (e.handle, e.grad, e.m, e.v, e.vmax, e.master):
                if t is not None:
                    self.engine.unregister(t)
            if _grad_of(e.param) is e.proxy:
                _set_grad(e.param, None)
            e.param.__class__ = e.cls
            del e.param.__dict__["_zinf"]
            self._entries.pop(0)

    # ---- fetched copies -------------------------------------------------------------------

    def fetch_all(self, handles, tier, dirty=False):
        return self.engine.fetch_all(handles, tier, dirty=dirty, **self._fetch_kw)

    def _acquire(self, entries, why):
        """One more holder of each entry's fetched copy; the ones not resident yet are
        fetched as one set (zinf_fetch_all: the tier makes room for the whole set)."""
        need = [e for e in entries if not e.users]
        if need:
            for e in need:
                if e.pending is not None:
                    self.ensure(e)
            if self.z3 is not None:     # stage 3: gathered, one collective for the set
                pins = self.z3.gather(self, need, self.tier)
            else:
                pins = self.engine.fetch_all([e.handle for e in need], self.tier,
                                             **self._fetch_kw)
            self.fetches[why] += len(need)
            try:
                views = [pin.view if self.z3 else view_as(pin, e.shape, e.dtype)
                         for pin, e in zip(pins, need)]
            except BaseException:
                for pin in pins:
                    pin.release()
                raise
            by_storage = self._by_storage
            for e, pin, view in zip(need, pins, views):
                p = e.param
                # Standing (the backward between its gradient's two hooks), p.grad is
                # torch's own, or None until AccumulateGrad: left for _grad_ready.
                grad_idle = e.has_grad and not e.standing
                if grad_idle:
                    self._sync_grad(e)
                # While fetched it is a plain Parameter: no check on each operation, and
                # nothing of zinf for torch.compile to trace.
                p.__class__ = e.cls
                if grad_idle:
                    p.grad = None
                p.data = view
                e.pin, e.view = pin, view
                by_storage[pin.ptr] = e
                if not e.ordered:
                    self._first_use(e, view)
                if not e.hooked and p.requires_grad:   # unfrozen since (requires_grad_)
                    self._hook_grad(e)
        for e in entries:
            e.users += 1

    def _first_use(self, e, view):
        """What the first fetch of an entry learns: its place in the order of first use, the
        device of its copies and an empty tensor of its kind."""
        e.ordered = True
        self._order.append(e)
        if self._cuda is None:
            self._cuda = view.device if view.device.type == "cuda" else False
        e.empty = self._empty(e.dtype, view.device)

    def _drop(self, e):
        e.users -= 1
        if e.users:
            return
        if self._cuda:
            torch.cuda.current_stream(self._cuda).synchronize()
        view, pin = e.view, e.pin
        e.view = e.pin = None
        p = e.param
        self._by_storage.pop(pin.ptr, None)
        p.data = e.standin if e.standing else e.empty   # AccumulateGrad may still come
        if e.has_grad and not e.standing:
            # Before the class changes: a ZinfParameter would take p.grad = through
            # __torch_function__.
            if e.proxy is None:
                e.proxy = GradProxy.make(e, p)
            p.grad = e.proxy
        p.__class__ = e.zcls
        if not e.dirty:
            pin.release()
            return
        e.dirty = False
        try:
            if self.z3 is not None:     # this rank's slice of what the holder wrote
                self.z3.write(self, e, view)
            elif e.master is not None:
                with self.engine.fetch(e.master, "host", dirty=True) as mp:
                    view_as(mp, e.shape, torch.float32).copy_(view)
            del view
        finally:
            pin.release(dirty=True)

    def _empty(self, dtype, device):
        key = (dtype, device)
        t = self._empties.get(key)
        if t is None:
            t = self._empties[key] = torch.empty(0, dtype=dtype, device=device)
        return t

    def ensure(self, e):
        """e's deferred update (AdamW(overlap=True)) carried out now, before anything reads
        or overwrites what it reads or writes."""
        with self._lock:
            if e.pending is not None:
                e.pending[0]._run_pending(e)

    def settle(self):
        """Every deferred update of this module's parameters carried out."""
        with self._lock:
            for e in self._entries:
                if e.pending is not None:
                    e.pending[0]._run_pending(e)

    def prefetch_forward(self):
        """After an update: hint the engine to bring the parameters back into the tier the
        forward uses, in the order the forward first used them, up to half the tier (the
        rest would only push the first ones out), so that the next forward's fetches find
        them copied rather than each waiting for its own copy."""
        room = self._tier_room // 2
        for e in self._order:
            if e.pending is not None:
                continue        # its update comes first: copied up after it
            room -= page_round(e.nbytes)
            if room < 0:
                break
            self.engine.prefetch(e.handle, self.tier)

    def _put_proxy(self, e):
        if e.has_grad:
            if e.proxy is None:
                e.proxy = GradProxy.make(e, e.param)
            _set_grad(e.param, e.proxy)

    def release_stale(self):
        """Holds a backward took and never gave back (it raised before its end), given back
        where no backward runs."""
        with self._lock:
            if _in_backward():
                return
            self._callback_queued = False
            if self.z3 is not None:
                self.z3.forget()
            for e in self._entries:
                if e.in_backward:
                    e.in_backward = False
                    self._drop(e)
                if e.standing:
                    self._end_standing(e)
            while self._loading:
                self._drop(self._loading.pop())

    # ---- module hooks ---------------------------------------------------------------------

    def _root_pre(self, m, args):
        if self._callback_queued or self._loading:
            self.release_stale()

    def _make_pre(self, own, root):
        @torch.compiler.disable
        def pre(m, args):
            with self._lock:
                if root and (self._callback_queued or self._loading):
                    self.release_stale()
                self._acquire(own, "forward")
                # A module called outside the root's forward (a submodule on its own, a
                # re-entrant checkpoint's recompute in the backward) saves its views of
                # parameters through zinf's hooks too: they are pushed for its forward,
                # unless other hooks are on (a non-re-entrant checkpoint's recompute keeps
                # what it saves itself, and its views keep their pins).
                tls = self._tls
                pushed = not getattr(tls, "depth", 0) and _saved_hooks_free()
                if pushed:
                    _push_saved(self._pack, self._unpack)
                    tls.depth = 1
                self._calls.setdefault(id(m), []).append((own, pushed))

        return pre

    def _make_post(self, own):
        # The backward needs no hook of the module's: a parameter autograd saved is fetched
        # as it is unpacked (_unpack), and a gradient goes into zinf from its own hooks
        # (_grad_pre, _grad_ready), with nothing fetched.
        @torch.compiler.disable
        def post(m, args, result):
            with self._lock:
                stack = self._calls.get(id(m))
                if not stack:
                    return      # the pre-hook raised before it acquired anything
                got, pushed = stack.pop()
                if pushed:
                    self._tls.depth = 0
                    _pop_saved()
                for e in got:
                    self._drop(e)

        return post

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
            if self.z3 is not None:
                self.z3.flush(self)
            for e in self._entries:
                if e.in_backward:
                    e.in_backward = False
                    self._drop(e)
                if e.standing:
                    self._end_standing(e)

    def _pack(self, t):
        # A fetched parameter is a plain Parameter (nothing of zinf's __torch_function__ to
        # step around); a tensor without storage (sparse) is saved as it is.
        try:
            e = self._by_storage.get(t.untyped_storage().data_ptr())
        except Exception:
            return t
        if e is None or t.dtype != e.dtype:
            return t
        return _Saved(e, t.storage_offset(), t.shape, t.stride())

    def _unpack(self, s):
        """A saved view of a parameter, for the node that unpacks it. Where the parameter is
        fetched (a forward running again under checkpointing, a gather), a view of that
        copy; else it is fetched, and the pin released at once: the view keeps it (DLPack)
        until autograd lets the view go after the node, so nothing is held longer than the
        node runs. On a GPU the node's kernels may still read the copy once the view goes:
        there the copy is held until the gradient is in (or the backward ends), and the
        release waits for the stream."""
        if not isinstance(s, _Saved):
            return s
        e = s.entry
        with self._lock:
            if e.pending is not None:
                self.ensure(e)
            if e.view is None and self._cuda:
                self._queue_end_of_backward()
                self._hold_for_backward([e], "unpack")
            if e.view is not None:
                return torch.as_strided(e.view, s.size, s.stride, s.offset)
            if self.z3 is not None:     # gathered again; the view keeps the memory
                self.fetches["unpack"] += 1
                full = self.z3.gather(self, [e], self.tier)[0]
                return torch.as_strided(full.view, s.size, s.stride, s.offset)
            pin = self.engine.fetch(e.handle, self.tier, **self._fetch_kw)
            self.fetches["unpack"] += 1
            try:
                return torch.as_strided(view_as(pin, e.shape, e.dtype), s.size, s.stride,
                                        s.offset)
            finally:
                pin.release()
                # Held until the view goes (remove() refuses meanwhile).
                if len(self._unpacked) > 256:
                    self._unpacked = [q for q in self._unpacked if not q.dropped]
                self._unpacked.append(pin)

    # ---- state dicts, copies --------------------------------------------------------------

    def read(self, e):
        """The parameter's values, a CPU tensor of its dtype (a copy)."""
        with self._lock:
            if e.pending is not None:
                self.ensure(e)
            if e.view is not None:
                with _disabled():
                    return e.view.detach().to("cpu", copy=True)
            if self.z3 is not None:     # a collective: every rank reads it
                with _disabled():
                    return self.z3.gather(self, [e], "host")[0].view.to("cpu", copy=True)
            with self.engine.fetch(e.handle, "host") as pin:
                return view_as(pin, e.shape, e.dtype).clone()

    def write(self, e, values):
        """values (any dtype and device, the parameter's shape) into the parameter in zinf,
        and into its float32 master copy where it has one."""
        if tuple(values.shape) != e.shape:
            raise ValueError(f"{e.name}: shape {tuple(values.shape)}, the parameter's is "
                             f"{e.shape}")
        with self._lock:
            if e.pending is not None:
                self.ensure(e)
            if self.z3 is not None:
                return self.z3.write(self, e, values)
            with self.engine.fetch(e.handle, "host", dirty=True) as pin:
                with _disabled():
                    view_as(pin, e.shape, e.dtype).copy_(values)
            if e.master is not None:
                with self.engine.fetch(e.master, "host", dirty=True) as pin:
                    with _disabled():
                        view_as(pin, e.shape, torch.float32).copy_(values)

    def _state_dict_hook(self, m, sd, prefix, local_metadata):
        ref, cache = self._sd_cache
        try:
            if ref is None or ref() is not sd:
                cache = {}
                self._sd_cache = (weakref.ref(sd), cache)
        except TypeError:     # a destination that takes no weak reference: no aliases kept
            cache = {}
        for name, p in m._parameters.items():
            e = p.__dict__.get("_zinf") if p is not None else None
            key = prefix + name
            if e is None or e.owner is not self or key not in sd or sd[key] is p:
                continue      # keep_vars=True gives the Parameter itself
            if e not in cache:
                cache[e] = self.read(e)
            sd[key] = cache[e]

    def _load_pre(self, m, sd, prefix, local_metadata, strict, missing, unexpected, errs):
        if local_metadata.get("assign_to_params_buffers"):
            raise OffloadedError("zinf.torch: load_state_dict(assign=True) would replace "
                                 "offloaded parameters; load without assign")
        own = [p.__dict__["_zinf"] for name, p in m._parameters.items()
               if p is not None and prefix + name in sd and p.__dict__.get("_zinf")]
        own = list(dict.fromkeys(own))
        if not own:
            return
        with self._lock:
            self._acquire(own, "gather")
            for e in own:
                e.dirty = True
                self._loading.append(e)

    def _load_post(self, m, incompatible):
        with self._lock:
            mine = [e for e in self._loading if e.param in set(m._parameters.values())]
            for e in mine:
                self._loading.remove(e)
                self._drop(e)

    def state_dict(self, *args, **kwargs):
        """The module's state_dict(): every parameter (tied aliases included) with its
        values, and the buffers."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, values, strict=True):
        """The module's load_state_dict(): the values written into zinf."""
        return self.module.load_state_dict(values, strict=strict)

    def _hook_dicts(self):
        out = collections.defaultdict(set)
        for h in self._hooks:
            refs = [h.hooks_dict_ref] + list(getattr(h, "extra_dict_ref", ()) or ())
            for r in refs:
                d = r()
                if d is not None:
                    out[id(d)].add(h.id)
        return out

    def plain_copy(self, memo=None):
        """A copy of the module in memory, without zinf: each parameter with its values."""
        memo = {} if memo is None else memo
        with self._lock:
            for e in self._entries:
                if id(e.param) not in memo:
                    memo[id(e.param)] = torch.nn.Parameter(self.read(e),
                                                           e.param.requires_grad)
            ours = self._hook_dicts()
            for m in self.module.modules():
                for d in list(vars(m).values()):
                    if isinstance(d, dict) and id(d) in ours:
                        memo[id(d)] = type(d)((k, copy.deepcopy(v, memo))
                                              for k, v in d.items() if k not in ours[id(d)])
            saved = {k: self.module.__dict__.pop(k)
                     for k in ("__deepcopy__", "__reduce_ex__", "forward", "zinf_offload",
                               ddp.KEY)
                     if k in self.module.__dict__}
            try:
                if self._own_forward is not None:
                    self.module.__dict__["forward"] = self._own_forward
                new = copy.deepcopy(self.module, memo)
            finally:
                self.module.__dict__.pop("forward", None)
                self.module.__dict__.update(saved)
        return new

    def _deepcopy(self, memo):
        return self.plain_copy(memo)

    def _reduce_ex(self, proto):
        return self.plain_copy().__reduce_ex__(proto)

    # ---- the user's calls -------------------------------------------------------------------

    def remove(self):
        """Take the hooks off and put each parameter's values back into it (CPU memory);
        the zinf tensors are unregistered."""
        with self._lock:
            self.release_stale()
            self._unpacked = [q for q in self._unpacked if not q.dropped]
            if any(e.users for e in self._entries) or self._unpacked:
                raise RuntimeError("a forward or backward still holds parameters")
            self._unhook()
            self._unregister_all()

    def _unhook(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for k in ("forward", "zinf_offload", "__deepcopy__", "__reduce_ex__", ddp.KEY):
            self.module.__dict__.pop(k, None)
        if self._own_forward is not None:
            self.module.forward = self._own_forward

    def discard(self):
        """remove() for a module whose values are not wanted: the hooks off, the zinf
        tensors unregistered, each parameter left empty."""
        with self._lock:
            self._unhook()
            for e in self._entries:
                e.pending = None
                for t in (e.handle, e.grad, e.m, e.v, e.vmax, e.master):
                    if t is not None:
                        try:
                            self.engine.unregister(t)
                        except Error:
                            pass
                e.param.__class__ = e.cls
                e.param.__dict__.pop("_zinf", None)
            self._entries = []


def offload(module, engine, *, home="nvme", tier="device", prefix="", resume=False, wait=30.0,
            group=None, stage=None, bucket_bytes=BUCKET_BYTES):
    """Move module's parameters into engine (see zinf.torch's docstring); returns the
    Offload. home: where their permanent copies live ("nvme", "host" or "device"); tier:
    where forward and backward use them ("device" or "host"); prefix: put before each
    zinf tensor's name; resume: look the tensors up (an engine opened with resume=True)
    instead of registering and writing them; wait: a fetch that finds its tier full of
    other threads' pins waits up to this many seconds for room (True: without a limit; 0 or
    None: not at all) before it fails with ENOMEM. A limit, by default: a thread that holds
    pins in the tier itself (an outer module's parameters) may wait for room only it could
    give back.

    group: a torch.distributed ProcessGroup (dist.group.WORLD, or one of dist.new_group) for
    data parallelism: every rank offloads the same model into its own engine, and the
    gradients become the mean over the group's ranks, reduced once per optimizer step by
    whatever reads them first (clip_grad_norm_, GradScaler, gathered(grads=True), the step),
    in buckets of bucket_bytes (one all_reduce each).
    stage: how much the ranks partition. stage=1 (ZeRO stage 1): zinf.torch.AdamW keeps each
    parameter's optimizer state on one rank, which updates it and broadcasts the new values.
    stage=2: each gradient is reduced to that rank alone, and the others forget theirs,
    keeping its 2-norm and finiteness (exchanged) for clip_grad_norm_ and GradScaler; any
    other read of it there raises OffloadedError. stage=3 (the default with a group): each
    rank's engine homes its 1/N slice of every parameter, gradient and moment; a module's
    parameters are gathered (all_gather) for its forward and for the saved views its
    backward unpacks, and dropped after; the backward's gradients are averaged over the
    group in buckets of bucket_bytes (float32 bytes, 25 MiB by default) and each rank keeps
    its slice. p.grad, state_dict(), read parameters and gathered() gather what they read,
    so every rank must read them alike (collectives). The ranks must start with the same
    parameters (checked: an error names the first that differs)."""
    return Offload(module, engine, home=home, tier=tier, prefix=prefix, resume=resume,
                   wait=wait, group=group, stage=stage, bucket_bytes=bucket_bytes)


@contextlib.contextmanager
def gathered(params, *, modify=False, grads=False):
    """Offloaded parameters made real for the block: each Parameter holds its values (in
    the tier the forward uses), as inside its module's forward. modify=True: what the block
    writes into them is kept (their fp32 master copies follow). grads=True: p.grad holds the
    real gradient too (float32; a copy for a 16-bit parameter, whose writes are not kept),
    with any pending scale (clipping, unscaling) applied. Parameters that are not offloaded
    are left as they are."""
    if isinstance(params, torch.Tensor):
        params = [params]
    by_owner = collections.OrderedDict()
    for p in params:
        e = p.__dict__.get("_zinf")
        if e is not None:
            by_owner.setdefault(e.owner, []).append(e)
    held = []
    try:
        for off, entries in by_owner.items():
            entries = list(dict.fromkeys(entries))
            with off._lock:
                off.release_stale()
                if grads:
                    off.reduce_grads()
                off._acquire(entries, "gather")
                held.append((off, entries, []))
                for e in entries:
                    if modify:
                        e.dirty = True
                    if grads and e.has_grad and off.z3 is not None:
                        # Stage 3: the full mean gathered; this rank's slice of what the
                        # block leaves in it is written back.
                        g = off.z3.full_grad(off, e).clone()
                        held[-1][2].append((e, g))
                        _set_grad(e.param, g.to(dtype=e.dtype, device=e.view.device)
                                  if e.dtype != g.dtype or g.device != e.view.device else g)
                    elif grads and e.has_grad:
                        off._refuse_remote(e, "gathered(grads=True)")
                        pin = off.engine.fetch(e.grad, "host", dirty=True)
                        held[-1][2].append((e, pin))
                        with _disabled():
                            g = view_as(pin, e.shape, torch.float32)
                            if e.gscale != 1.0:
                                g.mul_(e.gscale)
                                e.gscale = 1.0
                            if g.dtype != e.dtype or g.device != e.view.device:
                                g = g.to(dtype=e.dtype, device=e.view.device)
                        _set_grad(e.param, g)
        yield
    finally:
        for off, entries, gpins in reversed(held):
            with off._lock:
                for e, pin in gpins:
                    _set_grad(e.param, None)
                    if off.z3 is not None:
                        off.z3.put_grad(off, e, pin)
                        continue
                    off._note_grad(e, pin)
                    pin.release(dirty=True)
                for e in entries:
                    off._drop(e)
