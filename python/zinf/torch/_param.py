"""What torch sees of an offloaded parameter and of its gradient between uses.

An offloaded Parameter's class becomes a subclass of its own (ZinfParameter): while its
values are fetched (a forward, a backward, zinf.torch.gathered) it is an ordinary
Parameter over the fetched copy; between uses it is empty (p.data has 0 elements, and
p.shape is (0,): zinf.torch.shape_of(p) is its own), and any torch operation that would
read or write its values raises OffloadedError, naming the parameter and the way to reach
it, instead of computing with an empty tensor. What tells about the tensor (dtype, device,
requires_grad, hooks, hashing) works at any time, and p.numel() counts its own elements.

Its gradient lies in zinf. Between a backward and the next zero_grad(), p.grad is a
GradProxy: an empty tensor that stands for the gradient in zinf and carries out the few
operations that torch's own code applies to gradients without copying them:
- the norms torch.nn.utils.clip_grad_norm_ takes (torch.linalg.vector_norm, Tensor.norm,
  torch._foreach_norm): the 2-norm is the one taken as the gradient was accumulated, any
  other is computed from the gradient in zinf;
- scaling in place (mul_, div_, their _foreach forms): kept as a factor that the next
  update or accumulation applies;
- zero_() and torch._foreach_zero_ (zero_grad(set_to_none=False), module or optimizer):
  the gradient in zinf becomes zeros;
- clamp_ (clip_grad_value_), and GradScaler's unscale (the found-inf check against the
  flag taken as the gradient was accumulated);
- requires_grad_() and detach_(), which gradients get from zero_grad.
Anything else raises OffloadedError; at stage 3 (offload(..., stage=3)) any other read gets
the full gradient, gathered from the ranks' slices (a collective) and cached until it
changes, and only writes raise. zinf.torch.gathered(params, grads=True) gives the real
gradients.
"""

import math

import torch

__all__ = ["OffloadedError", "GradProxy", "param_class", "META"]


class OffloadedError(RuntimeError):
    """A parameter or gradient of an offloaded module was read where its values are not
    fetched. .name: the parameter's."""

    entry = None

    @classmethod
    def about(cls, entry, msg):
        err = cls(msg)
        err.entry = entry
        err.name = entry.name
        return err


# Calls that tell about a tensor without reading its values, allowed at any time.
META = frozenset({
    "__get__", "__set__", "__delete__", "size", "dim", "ndimension", "numel", "nelement",
    "stride", "storage_offset", "is_contiguous", "is_floating_point", "is_complex",
    "element_size", "data_ptr", "untyped_storage", "_typed_storage", "storage",
    "get_device", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "_is_view", "__hash__", "__repr__", "__format__", "__len__", "type", "is_pinned",
    "__reduce_ex__", "__setstate__", "__deepcopy__", "_has_compatible_shallow_copy_type",
    "retain_grad", "detach", "is_shared", "share_memory_",
})

_disabled = torch._C.DisableTorchFunctionSubclass

# What p.numel() answers between uses: the parameter's own count (what HF's num_parameters,
# Trainer's log and peft's count of trainable parameters add up), though p.data is empty.
COUNT = frozenset({"numel", "nelement"})


# Conversions Module.to(), .cpu(), .cuda() apply: a move between devices changes nothing of
# an offloaded parameter (its copies are fetched where its engine puts them); a change of
# dtype would part it from what zinf holds, and is refused.
CONVERT = frozenset({"to", "cpu", "cuda", "float", "half", "bfloat16", "double", "type",
                     "_to_copy"})


def _convert(p, func, args, kwargs):
    with _disabled():
        out = func(*args, **(kwargs or {}))
    e = p.__dict__["_zinf"]
    if out.dtype != e.dtype:
        raise OffloadedError(f"zinf.torch: {func.__name__}() would make parameter {e.name} "
                             f"{out.dtype}; it is offloaded as {e.dtype}: convert the model "
                             f"before zinf.torch.offload (or remove() it first)")
    return out


def _offloaded(a):
    e = a.__dict__.get("_zinf")
    return e is not None and e.view is None


def _refuse(e, name):
    raise OffloadedError.about(e,
        f"zinf.torch: {name} reads parameter {e.name}, whose values are offloaded (empty "
        f"outside its module's forward and backward): read it inside "
        f"`with zinf.torch.gathered(params):`, or through model.state_dict()")


def _check(args, kwargs, name):
    for a in args:
        if isinstance(a, ZinfParameter):
            if _offloaded(a):
                _refuse(a.__dict__["_zinf"], name)
        elif type(a) in (list, tuple):
            for b in a:
                if isinstance(b, ZinfParameter) and _offloaded(b):
                    _refuse(b.__dict__["_zinf"], name)
    if kwargs:
        _check(tuple(kwargs.values()), None, name)


class ZinfParameter(torch.nn.Parameter):
    """A Parameter whose values live in zinf (see the module's docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in CONVERT and args and isinstance(args[0], ZinfParameter) and \
                _offloaded(args[0]):
            return _convert(args[0], func, args, kwargs)
        if name in COUNT and len(args) == 1 and isinstance(args[0], ZinfParameter) and \
                _offloaded(args[0]):
            return math.prod(args[0].__dict__["_zinf"].shape)
        if name not in META:
            _check(args, kwargs, name)
        with _disabled():
            return func(*args, **(kwargs or {}))

    def __repr__(self):
        e = self.__dict__.get("_zinf")
        if e is None or e.view is not None:
            with _disabled():
                return super().__repr__()
        return (f"ZinfParameter({e.name!r}, shape={tuple(e.shape)}, dtype={e.dtype}, "
                f"offloaded)")

    def __deepcopy__(self, memo):
        e = self.__dict__.get("_zinf")
        if e is None:
            return super().__deepcopy__(memo)
        if id(self) not in memo:
            memo[id(self)] = torch.nn.Parameter(e.owner.read(e), self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, proto):
        e = self.__dict__.get("_zinf")
        if e is None:
            return super().__reduce_ex__(proto)
        return torch.nn.Parameter(e.owner.read(e), self.requires_grad).__reduce_ex__(proto)


_classes = {torch.nn.Parameter: ZinfParameter}


def param_class(cls):
    """The ZinfParameter subclass for a Parameter of class cls (a Parameter subclass of
    another library keeps its own class's behaviour underneath)."""
    c = _classes.get(cls)
    if c is None:
        c = _classes[cls] = type("Zinf" + cls.__name__, (ZinfParameter, cls), {})
    return c


# ---- gradients --------------------------------------------------------------------------


def _scalar(x):
    if isinstance(x, torch.Tensor):
        with _disabled():
            return float(x.item())
    return float(x)


def _ord(args, kwargs, i):
    o = kwargs.get("ord", kwargs.get("p", args[i] if len(args) > i else 2))
    if o is None or o == "fro":
        return 2.0
    return float(o)


def _norm(g, args, kwargs, i=1):
    if not isinstance(g, GradProxy):
        with _disabled():
            return torch.linalg.vector_norm(g, _ord(args, kwargs, i))
    if kwargs.get("dim") is not None or len(args) > i + 1:
        raise OffloadedError("zinf.torch: a gradient in zinf gives its norm over all its "
                             "elements only (no dim, keepdim or dtype)")
    return g.entry.owner.grad_norm(g.entry, _ord(args, kwargs, i))


def _each(x, n):
    return list(x) if isinstance(x, (list, tuple)) else [x] * n


def _scale_all(grads, factors):
    for g, f in zip(grads, factors):
        if isinstance(g, GradProxy):
            g.entry.owner.grad_scale(g.entry, _scalar(f))
        else:
            with _disabled():
                g.mul_(f)


def _h_norm(args, kwargs):
    return _norm(args[0], args, kwargs)


def _h_foreach_norm(args, kwargs):
    return [_norm(g, (g,) + tuple(args[1:2]), kwargs) for g in args[0]]


def _h_mul_(args, kwargs):
    _scale_all([args[0]], [args[1]])
    return args[0]


def _h_div_(args, kwargs):
    _scale_all([args[0]], [1.0 / _scalar(args[1])])
    return args[0]


def _h_foreach_mul_(args, kwargs):
    _scale_all(args[0], _each(args[1], len(args[0])))


def _h_foreach_div_(args, kwargs):
    _scale_all(args[0], [1.0 / _scalar(f) for f in _each(args[1], len(args[0]))])


def _h_zero_(args, kwargs):
    args[0].entry.owner.grad_zero(args[0].entry)
    return args[0]


def _h_foreach_zero_(args, kwargs):
    for g in args[0]:
        if isinstance(g, GradProxy):
            g.entry.owner.grad_zero(g.entry)
        else:
            with _disabled():
                g.zero_()


def _h_self(args, kwargs):
    return args[0]


def _clamp(g, lo, hi):
    if isinstance(g, GradProxy):
        g.entry.owner.grad_clamp(g.entry, lo, hi)
    else:
        with _disabled():
            g.clamp_(lo, hi)


def _h_clamp_(args, kwargs):
    lo = kwargs.get("min", args[1] if len(args) > 1 else None)
    hi = kwargs.get("max", args[2] if len(args) > 2 else None)
    _clamp(args[0], None if lo is None else _scalar(lo), None if hi is None else _scalar(hi))
    return args[0]


def _h_foreach_clamp_min_(args, kwargs):
    for g, v in zip(args[0], _each(args[1], len(args[0]))):
        _clamp(g, _scalar(v), None)


def _h_foreach_clamp_max_(args, kwargs):
    for g, v in zip(args[0], _each(args[1], len(args[0]))):
        _clamp(g, None, _scalar(v))


def _h_unscale(args, kwargs):
    grads, found_inf, inv_scale = args[0], args[1], args[2]
    real = [g for g in grads if not isinstance(g, GradProxy)]
    if real:
        with _disabled():
            torch._amp_foreach_non_finite_check_and_unscale_(real, found_inf, inv_scale)
    s = _scalar(inv_scale)
    for g in grads:
        if isinstance(g, GradProxy):
            if g.entry.owner.grad_nonfinite(g.entry):
                with _disabled():
                    found_inf.fill_(1.0)
            g.entry.owner.grad_scale(g.entry, s)


_GRAD_OPS = {
    "vector_norm": _h_norm, "norm": _h_norm, "linalg_vector_norm": _h_norm,
    "_foreach_norm": _h_foreach_norm,
    "mul_": _h_mul_, "div_": _h_div_, "_foreach_mul_": _h_foreach_mul_,
    "_foreach_div_": _h_foreach_div_,
    "zero_": _h_zero_, "_foreach_zero_": _h_foreach_zero_,
    "requires_grad_": _h_self, "detach_": _h_self,
    "to": _h_self, "cpu": _h_self, "cuda": _h_self, "_to_copy": _h_self,
    "clamp_": _h_clamp_, "_foreach_clamp_min_": _h_foreach_clamp_min_,
    "_foreach_clamp_max_": _h_foreach_clamp_max_,
    "_amp_foreach_non_finite_check_and_unscale_": _h_unscale,
}


def _reads_only(name, kwargs):
    """An operation that does not write its arguments (in place, or into out=)."""
    inplace = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
    return not inplace and "out" not in kwargs and name not in ("__setitem__", "set_")


def _stage3(args):
    g = next((a for a in args if isinstance(a, GradProxy)), None)
    return g is not None and g.entry is not None and \
        getattr(g.entry.owner, "z3", None) is not None


def _full_grads(args):
    out = []
    for a in args:
        if isinstance(a, GradProxy) and a.entry is not None:
            a = a.entry.owner.z3.full_grad(a.entry.owner, a.entry)
        elif type(a) in (list, tuple):
            a = type(a)(_full_grads(a))
        out.append(a)
    return out


class GradProxy(torch.Tensor):
    """p.grad of an offloaded parameter between a backward and zero_grad() (see the
    module's docstring)."""

    entry = None

    @staticmethod
    def make(entry, like):
        with _disabled():
            g = torch.Tensor._make_subclass(GradProxy, torch.empty(0, dtype=like.dtype,
                                                                   device=like.device))
        g.entry = entry
        return g

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in META:
            if name == "__get__" and func.__self__.__name__ == "dtype" and args:
                # The gradient in zinf is float32 whatever the parameter's dtype (GradScaler
                # refuses to unscale float16 gradients, and this one is not).
                g = args[0]
                if isinstance(g, GradProxy) and g.entry is not None:
                    return torch.float32
            with _disabled():
                return func(*args, **kwargs)
        h = _GRAD_OPS.get(name)
        if h is not None:
            return h(args, kwargs)
        if _reads_only(name, kwargs) and _stage3(args):
            # Stage 3: the full gradient gathered from the ranks' slices (a collective,
            # cached until it changes) stands in for any read.
            args = _full_grads(args)
            kwargs = dict(zip(kwargs, _full_grads(tuple(kwargs.values()))))
            with _disabled():
                return func(*args, **kwargs)
        who = next((a.entry.name for a in args if isinstance(a, GradProxy)), "?")
        raise OffloadedError(
            f"zinf.torch: {name} reads the gradient of {who}, which lies in zinf (p.grad "
            f"stands for it between the backward and zero_grad()): read it inside "
            f"`with zinf.torch.gathered(params, grads=True):`; clip_grad_norm_, "
            f"clip_grad_value_, GradScaler and zero_grad work as they are")

    def __repr__(self):
        e = self.entry
        return f"GradProxy(gradient of {e.name if e else '?'} in zinf)"
