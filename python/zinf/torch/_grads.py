"""The gradients of an offloaded module's parameters, which lie in zinf: their hooks in the
backward (_grad_pre, _grad_ready) and what GradProxy asks of them (norms, scaling, zeroing,
clamping). Offload takes these as a mixin; they use its lock, engine and entries."""

import math

import torch

from .._zinf import _grad_add
from ._param import GradProxy, OffloadedError
from ._views import _GRAD_CODES, _disabled, _grad_of, _set_grad, torch_view, view_as, zero


class GradsMixin:
    def reduce_grads(self):
        """With a group (offload(..., group=)): the gradients made the mean over its ranks,
        where a backward accumulated into them since the last reduction; whatever reads them
        calls this first (norms, clamps, GradScaler's check, gathered, AdamW.step). Stage 3
        reduced them in the backward: the slices' norms are made the full ones here."""
        if self.z3 is not None:
            with self._lock:
                self.z3.exchange(self)
        elif self.dist is not None and self._unreduced:
            with self._lock:
                self.dist.reduce(self)

    def _sync_grad(self, e):
        """What torch did to p.grad since the proxy went in: set it to None (zero_grad of a
        module or of another optimizer) forgets the gradient in zinf."""
        if not e.has_grad:
            return
        g = _grad_of(e.param)
        if g is e.proxy and g is not None:
            return
        # None, or another tensor (torch lets only an empty one in while the parameter is
        # empty): the gradient is gone.
        self.forget_grad(e)

    def forget_grad(self, e):
        """The gradient gone (set to None): the next step skips the parameter, and the next
        accumulation overwrites without reading what zinf holds."""
        was = e.has_grad
        e.has_grad, e.fresh, e.gnorm, e.gscale, e.nonfinite = False, True, None, 1.0, False
        if self.dist is not None:
            self.dist.forget(e)
        if self.z3 is not None:
            self.z3.changed(e)
        if was and e.grad is not None:
            if e.pending is not None:
                e.zero_later = True     # the deferred update reads it first
            else:
                zero(self.engine, e.grad)
        if e.view is None and _grad_of(e.param) is e.proxy:
            _set_grad(e.param, None)

    def _grad_pre(self, e, grad):
        """Before AccumulateGrad stores the parameter's gradient: an idle parameter gets its
        shape back (the stand-in) and no p.grad (the proxy would be added to), until
        _grad_ready has the gradient in zinf."""
        with self._lock:
            if e.pending is not None:
                self.ensure(e)      # the update reads the gradient this one overwrites
            self._queue_end_of_backward()
            if e.view is None and not e.standing:
                st = e.standin
                if st is None:
                    st = e.standin = self._nan(e.dtype, grad.device).expand(e.shape)
                with _disabled():
                    p = e.param
                    p.grad = None
                    p.data = st
                e.standing = True

    def _end_standing(self, e):
        """Between the gradient's hooks no more: an idle parameter drops its stand-in; one
        fetched meanwhile keeps its copy, and its last _drop puts the proxy."""
        if e.view is None:
            self._unstand(e)
        else:
            e.standing = False

    def _unstand(self, e):
        """The stand-in gone: the parameter empty again, its gradient's proxy back."""
        e.standing = False
        p = e.param
        with _disabled():
            p.data = e.empty if e.empty is not None else self._empty(e.dtype, e.standin.device)
            if e.has_grad:
                if e.proxy is None:
                    e.proxy = GradProxy.make(e, p)
                p.grad = e.proxy

    def _nan(self, dtype, device):
        key = ("nan", dtype, device)
        t = self._empties.get(key)
        if t is None:
            t = self._empties[key] = torch.full((), float("nan"), dtype=dtype, device=device)
        return t

    def _grad_ready(self, p):
        e = p.__dict__["_zinf"]
        with _disabled():
            g = p.grad
            p.grad = None
        code = _GRAD_CODES.get(g.dtype)
        if code is None:
            raise TypeError(f"zinf.torch: the gradient of {e.name} is {g.dtype}, not a "
                            "floating dtype zinf.torch accumulates")
        z3 = self.z3
        if not g.is_cpu and not (z3 and z3.tensor_forms):
            g = g.to("cpu")     # waits for the stream: the copy is whole when it returns
        if not g.is_contiguous():
            g = g.contiguous()
        with self._lock:
            if e.pending is not None:
                self.ensure(e)
            if z3 is not None:
                # Stage 3: into the bucket, averaged and kept as this rank's slice when it
                # is sent (z3.flush: has_grad, the norm and the proxy then).
                z3.add_grad(self, e, g)
                if e.standing:
                    self._end_standing(e)
                elif e.in_backward:
                    e.in_backward = False
                    self._drop(e)
                return
            scale = e.gscale
            if self.dist is not None:
                scale *= self.dist.accumulate_scale(e)
            sumsq = self.engine._grad_add(self.grad_handle(e), g.data_ptr(), g.numel(), code,
                                          scale, not e.has_grad or e.fresh)
            # The 2-norm, for clip_grad_norm_, and an inf or nan (sum of squares not finite:
            # no finite float32's square overflows a double), for GradScaler's skip.
            e.gnorm = math.sqrt(sumsq)
            e.nonfinite = not math.isfinite(sumsq)
            e.gscale = 1.0
            e.has_grad, e.fresh = True, False
            self._unreduced = True
            if e.standing:
                self._end_standing(e)
            elif e.in_backward:
                e.in_backward = False
                self._drop(e)
            elif e.view is None:
                self._put_proxy(e)

    def grad_norm(self, e, ord):
        self.reduce_grads()
        with self._lock:
            if not e.has_grad:
                return torch.zeros((), dtype=torch.float32)
            if ord == 2.0 and e.gnorm is not None:
                return torch.tensor(e.gnorm, dtype=torch.float32)
            self._refuse_remote(e, f"its {ord}-norm")
            if self.z3 is not None:     # the full gradient (padding would count)
                with _disabled():
                    return torch.linalg.vector_norm(self.z3.full_grad(self, e), ord)
            with self.engine.fetch(e.grad, "host") as pin:
                with _disabled():
                    n = torch.linalg.vector_norm(view_as(pin, e.shape, torch.float32), ord)
            return n * abs(e.gscale)

    def grad_scale(self, e, s):
        with self._lock:
            e.gscale *= s
            if e.gnorm is not None:
                e.gnorm *= abs(s)

    def _refuse_remote(self, e, what):
        """Stage 2: a gradient that lies on its owner's rank only is not read here."""
        if self.dist is not None and self.dist.is_remote(e):
            raise OffloadedError.about(
                e, f"{e.name}: its gradient lies on rank {self.dist.owners[id(e)]} of the "
                   f"group (stage=2 keeps each gradient on its owner, and every rank its "
                   f"2-norm); {what} is not taken on another rank")

    def grad_zero(self, e):
        with self._lock:
            if self.dist is not None:
                self.dist.forget(e)
            if e.pending is not None:
                e.zero_later = True     # the deferred update reads it first
            else:
                self._zero_grad_data(e)
            e.has_grad, e.fresh, e.gscale, e.nonfinite = True, True, 1.0, False
            e.gnorm = 0.0
            if self.z3 is not None:
                self.z3.changed(e)

    def _zero_grad_data(self, e):
        """Zeros in the gradient in zinf: without a byte moved where zinf takes it."""
        if not zero(self.engine, self.grad_handle(e)):
            with self.engine.fetch(e.grad, "host", dirty=True) as pin:
                torch_view(pin).zero_()

    def grad_clamp(self, e, lo, hi):
        self.reduce_grads()
        with self._lock:
            if self.dist is not None and self.dist.is_remote(e):
                # Its owner clamps it; the norm this rank kept is no longer its.
                e.gnorm, e.gscale = None, 1.0
                return
            if e.pending is not None:
                self.ensure(e)
            with self.engine.fetch(e.grad, "host", dirty=True) as pin:
                with _disabled():
                    v = view_as(pin, e.sshape, torch.float32)
                    if e.gscale != 1.0:
                        v.mul_(e.gscale)
                    v.clamp_(lo, hi)
                    if self.z3 is not None:
                        self.z3.zero_pad(e, v)
                del v
                self._note_grad(e, pin)

    def _note_grad(self, e, pin):
        """The gradient's norm and finiteness taken again from its pinned copy (changed in
        place), summed as _grad_ready sums it: _grad_add of the copy onto itself."""
        sumsq = _grad_add(pin, pin.ptr, pin.nbytes // 4, 0, 1.0, True)
        e.gnorm, e.nonfinite, e.gscale = math.sqrt(sumsq), not math.isfinite(sumsq), 1.0
        if self.z3 is not None:     # this slice's: exchanged at the next read
            self.z3.changed(e)

    def grad_nonfinite(self, e):
        self.reduce_grads()
        return e.nonfinite
