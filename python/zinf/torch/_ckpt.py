"""save_checkpoint() and load_checkpoint(): a training checkpoint of an offloaded model and
its zinf.torch.AdamW, each rank writing its own shard, that another number of ranks, at
another stage, loads back.

A checkpoint is a folder: one safetensors file a rank, "<tag>-rank-0000R-of-0000N.safetensors",
holding flat pieces of tensors, and "manifest.json", which says for every tensor its full
shape and dtype and which rank's file holds which flat range of it, with the world size,
the stage, the step and extra the caller gave, the optimizer's hyper-parameters and each
parameter's step count. What each rank writes: at stage 3 its slice of every parameter and
of its moments and master copy; at stages 1 and 2 rank 0 the parameters and each rank the
optimizer state of the parameters it owns; alone, the process all of it. Buffers and
parameters kept in memory are rank 0's. Loading, each rank reads from the pieces exactly the
ranges it now holds: whole tensors, or its slice of each at stage 3.

The files are written as temporaries and renamed, the manifest last (by rank 0, once every
rank's file is complete), under a tag new to each save: the folder's previous checkpoint
stays whole until the new manifest replaces it, and its files go after that.

What is not here: Hugging Face's layout (save() and load() in _io.py); the gradients (a
checkpoint is taken between steps, and loading one forgets them); a GradScaler's or a
scheduler's state (give them in extra=, as JSON)."""

import contextlib
import json
import os
import re
import struct
import uuid

import torch

from ._io import _items, agree, group_of
from ._views import _disabled, _numel, view_as

__all__ = ["save_checkpoint", "load_checkpoint", "MANIFEST"]

MANIFEST = "manifest.json"
FORMAT = "zinf.torch checkpoint"
_SHARD = re.compile(r"[0-9a-f]{12}-rank-\d{5}-of-\d{5}\.safetensors(\.tmp)?")
# The optimizer's tensors of a parameter, stored as "<name>:<key>" (no module's name holds
# a colon).
_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")


def _where(d):
    return (0, 1, None) if d is None else (d.rank, d.size, d.stage)


def _entry(t):
    return t.__dict__.get("_zinf") if isinstance(t, torch.nn.Parameter) else None


def _range(e, d):
    """The flat range of e's full values this rank holds: its slice at stage 3, else all."""
    if e.owner.z3 is not None:
        return e.owner.z3.range_of(e)
    return 0, _numel(e.shape)


def _read_slice(e, handle, dtype, a, b):
    """Elements [a, b) of e's tensor handle (its parameter or a state, which this rank holds
    from a on: a slice at stage 3), flat, a CPU copy."""
    lo = a - (e.owner.z3.range_of(e)[0] if e.owner.z3 is not None else 0)
    with e.owner.engine.fetch(handle, "host") as pin:
        with _disabled():
            return view_as(pin, e.sshape, dtype).reshape(-1)[lo:lo + b - a].clone()


def _names(model):
    """id(parameter) -> its name (the first, for a tied one)."""
    return {id(p): n for n, p in model.named_parameters()}


def _check_opt(optimizer, d):
    from ._optim import AdamW
    if optimizer is None:
        return
    if not isinstance(optimizer, AdamW):
        raise TypeError(f"zinf.torch checkpoints take a zinf.torch.AdamW, not "
                        f"{type(optimizer).__name__}")
    od = optimizer._dist
    if (od is None) != (d is None) or od is not None and od.group is not d.group:
        raise ValueError("zinf.torch: the optimizer steps parameters of another group than "
                         "the model's")
    optimizer._settle()


def _settle(model):
    for off in {id(e.owner): e.owner for e in map(_entry, model.parameters())
                if e is not None}.values():
        off.settle()


def _pieces(model, optimizer, d):
    """What this rank writes: [(key, full shape, dtype, a, b, read)], read() giving elements
    [a, b) of the tensor, flat; and {parameter name: step count} of the state it holds."""
    rank = _where(d)[0]
    out = []
    for name, t in _items(model):
        e = _entry(t)
        if e is None:           # buffers and parameters in memory: rank 0's
            if rank == 0:
                with _disabled():
                    v = t.detach().to("cpu").contiguous()
                out.append((name, tuple(v.shape), v.dtype, 0, v.numel(),
                            lambda v=v: v.reshape(-1)))
            continue
        if e.owner.z3 is None and rank != 0:
            continue            # stages 1 and 2: every rank holds them, rank 0 writes
        a, b = _range(e, d)
        if a < b:
            out.append((name, e.shape, e.dtype, a, b,
                        lambda e=e, a=a, b=b: _read_slice(e, e.handle, e.dtype, a, b)))
    steps = {}
    if optimizer is None:
        return out, steps
    names = _names(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            e = p._zinf
            st = optimizer.state.get(p, {})
            if id(p) not in names:
                raise ValueError(f"zinf.torch: the optimizer steps {e.name}, which is not a "
                                 f"parameter of the model")
            if not optimizer._mine(e) or not st.get("step"):
                continue
            name = names[id(p)]
            steps[name] = int(st["step"])
            a, b = _range(e, d)
            for key, h in zip(_STATE, (e.m, e.v, e.vmax if group["amsgrad"] else None,
                                       e.master)):
                if h is not None and a < b:
                    out.append((f"{name}:{key}", e.shape, torch.float32, a, b,
                                lambda e=e, h=h, a=a, b=b:
                                _read_slice(e, h, torch.float32, a, b)))
    return out, steps


def _json_value(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, tuple):
        return [_json_value(x) for x in v]
    return v


def _hyper(optimizer, names):
    groups = []
    for group in optimizer.param_groups:
        g = {k: _json_value(v) for k, v in group.items() if k != "params"}
        g["params"] = [names[id(p)] for p in group["params"]]
        groups.append(g)
    return groups


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


# safetensors' names of the dtypes a shard holds.
_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
       torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def _write_shard(path, pieces):
    """The pieces into a safetensors file at path, one in memory at a time (the header
    first: their sizes are known), as a temporary, synced, then renamed. Returns its
    bytes."""
    header, at = {"__metadata__": {"format": FORMAT}}, 0
    for key, _, dtype, a, b, _ in pieces:
        if dtype not in _ST:
            raise TypeError(f"zinf.torch.save_checkpoint: {key} is {dtype}, which a "
                            f"checkpoint does not hold")
        n = (b - a) * dtype.itemsize
        header[key] = {"dtype": _ST[dtype], "shape": [b - a], "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for key, _, dtype, a, b, read in pieces:
            v = read()
            if v.dtype != dtype or v.numel() != b - a:
                raise RuntimeError(f"zinf.torch.save_checkpoint: {key} read back as "
                                   f"{v.numel()} {v.dtype}, not {b - a} {dtype}")
            with _disabled():
                f.write(v.contiguous().view(torch.uint8).numpy().tobytes())
            del v
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return 8 + len(head) + at


def _gather(d, obj):
    if d is None:
        return [obj]
    out = [None] * d.size
    d.dist.all_gather_object(out, obj, group=d.group)
    return out


def _tag(d):
    box = [uuid.uuid4().hex[:12]]
    if d is not None:
        d.dist.broadcast_object_list(box, src=d._root(0), group=d.group)
    return box[0]


def save_checkpoint(directory, model, optimizer=None, *, step=None, extra=None):
    """Write a training checkpoint of model (offloaded, or a plain module) and its
    zinf.torch.AdamW into directory: each rank its own shard file, rank 0 the manifest.
    Across ranks every rank calls it, with the same arguments; each returns once the
    checkpoint is complete (or raises on every rank where one failed, which leaves the
    folder's previous checkpoint as it was). step (an int) and extra (anything JSON
    takes: a scheduler's or a GradScaler's state) are kept in the manifest and given back
    by load_checkpoint. The folder is shared by the ranks (one file system)."""
    d = group_of(model)
    rank, size, stage = _where(d)
    _check_opt(optimizer, d)
    _settle(model)
    if step is not None and not isinstance(step, int):
        raise TypeError(f"zinf.torch.save_checkpoint: step={step!r}; give an int or None")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise ValueError(f"zinf.torch.save_checkpoint: extra= is kept as JSON, and {err}")
    tag = _tag(d)
    fname = f"{tag}-rank-{rank:05d}-of-{size:05d}.safetensors"
    path = os.path.join(directory, fname)
    mine, err = None, None
    try:
        os.makedirs(directory, exist_ok=True)
        pieces, steps = _pieces(model, optimizer, d)
        nbytes = _write_shard(path, pieces)
        mine = {"pieces": [(k, list(s), str(t).removeprefix("torch."), a, b)
                           for k, s, t, a, b, _ in pieces],
                "steps": steps, "bytes": nbytes}
    except Exception as x:
        err = x
    parts = _gather(d, None if err else mine)
    if err is None and any(p is None for p in parts):
        err = RuntimeError(f"zinf.torch.save_checkpoint({directory!r}): rank "
                           f"{parts.index(None)} of the group failed to write its shard "
                           f"(its error is raised there); the previous checkpoint stands")
    if err is not None:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise err
    if rank == 0:
        try:
            _write_manifest(directory, model, optimizer, d, tag, parts, step, extra)
        except Exception as x:
            err = x
    agree(d, err, f"zinf.torch.save_checkpoint({directory!r})")


def _write_manifest(directory, model, optimizer, d, tag, parts, step, extra):
    rank, size, stage = _where(d)
    files = [f"{tag}-rank-{r:05d}-of-{size:05d}.safetensors" for r in range(size)]
    tensors, steps = {}, {}
    for r, part in enumerate(parts):
        for key, shape, dtype, a, b in part["pieces"]:
            t = tensors.setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
            t["pieces"].append([r, a, b])
        steps.update(part["steps"])
    manifest = {"format": FORMAT, "version": 1, "world_size": size, "stage": stage,
                "step": step, "extra": extra, "files": files,
                "file_bytes": [part["bytes"] for part in parts], "tensors": tensors,
                "optimizer": None if optimizer is None else {
                    "param_groups": _hyper(optimizer, _names(model)), "steps": steps}}
    _write_json(os.path.join(directory, MANIFEST), manifest)
    # The previous checkpoint's files, and temporaries a failed save left, go.
    for old in os.listdir(directory):
        if _SHARD.fullmatch(old) and old not in files:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, old))

# ---- loading ------------------------------------------------------------------------------


def _read_manifest(directory):
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no checkpoint manifest (save_checkpoint writes it "
                                f"last: a save that did not finish leaves none)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a checkpoint manifest ({err})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} manifest")
    if m.get("version") != 1:
        raise ValueError(f"{path}: version {m.get('version')!r}; this zinf reads version 1")
    return m


def _cut(path, size):
    """The first tensor of a safetensors file whose bytes lie past size, or None."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for key, v in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                             key=lambda kv: kv[1]["data_offsets"][0]):
            if 8 + n + v["data_offsets"][1] > size:
                return key
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        pass
    return None


class _Reader:
    """A checkpoint's shard files, each checked and opened once (in the caller's ExitStack),
    and the flat ranges of tensors read from their pieces."""

    def __init__(self, directory, manifest, stack):
        self.dir, self.m, self.stack, self.files = directory, manifest, stack, {}

    def _open(self, r, key):
        from safetensors import safe_open
        f = self.files.get(r)
        if f is not None:
            return f
        if not 0 <= r < len(self.m["files"]):
            raise ValueError(f"{os.path.join(self.dir, MANIFEST)}: {key} lies on rank {r}, "
                             f"which the checkpoint's {len(self.m['files'])} files lack")
        path = os.path.join(self.dir, self.m["files"][r])
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: missing; the checkpoint's manifest places "
                                    f"{key} (and rank {r}'s other pieces) there") from None
        want = self.m["file_bytes"][r]
        if size != want:
            cut = _cut(path, size) or key
            raise ValueError(f"{path}: {size} bytes where the manifest says {want} (a "
                             f"truncated or overwritten file): tensor {cut} lies past its "
                             f"end" if size < want else f"{path}: {size} bytes where the "
                             f"manifest says {want}: not the file this checkpoint wrote "
                             f"(tensor {key} is read from it)")
        try:
            f = self.stack.enter_context(safe_open(path, "pt"))
        except Exception as err:
            raise ValueError(f"{path}: unreadable as safetensors ({err}); the checkpoint "
                             f"reads {key} from it") from None
        self.files[r] = f
        return f

    def check(self, key, a, b):
        """The pieces of key cover [a, b), and each one to be read is in its file whole:
        else an error naming the file (or the manifest) and the tensor."""
        info, covered = self.m["tensors"][key], a
        for r, s, t in sorted(info["pieces"], key=lambda p: p[1]):
            if t <= covered or s >= b:
                continue
            if s > covered:
                break
            f = self._open(r, key)
            path = os.path.join(self.dir, self.m["files"][r])
            if key not in f.keys():
                raise ValueError(f"{path}: holds no {key}, which the manifest places there")
            if list(f.get_slice(key).get_shape()) != [t - s]:
                raise ValueError(f"{path}: {key} holds {f.get_slice(key).get_shape()} "
                                 f"elements; the manifest says [{t - s}]")
            covered = t
        if covered < b:
            raise ValueError(f"{os.path.join(self.dir, MANIFEST)}: no file holds elements "
                             f"{covered} to {b} of {key}")

    def read(self, key, a, b):
        """Elements [a, b) of key, flat, in its saved dtype."""
        info = self.m["tensors"][key]
        out = torch.empty(b - a, dtype=getattr(torch, info["dtype"]))
        for r, s, t in info["pieces"]:
            lo, hi = max(a, s), min(b, t)
            if lo < hi:
                out[lo - a:hi - a] = self._open(r, key).get_slice(key)[lo - s:hi - s]
        return out


def _plan(model, optimizer, m, reader, d):
    """What this rank reads and where it goes, every name, shape and range checked (and
    every file it reads from opened) before anything is written."""
    where = os.path.join(reader.dir, MANIFEST)
    tensors = m["tensors"]
    items = _items(model)
    have = {k for k in tensors if ":" not in k}
    missing = [n for n, _ in items if n not in have]
    unexpected = sorted(have - {n for n, _ in items})
    if missing or unexpected:
        raise KeyError(f"{where}: the checkpoint does not match the model: the model's "
                       f"{missing[:8]} are missing, the checkpoint's {unexpected[:8]} are "
                       f"not the model's")
    plan = []
    for name, t in items:
        e = _entry(t)
        shape = e.shape if e is not None else tuple(t.shape)
        if tuple(tensors[name]["shape"]) != tuple(shape):
            raise ValueError(f"{where}: {name} has shape {tuple(tensors[name]['shape'])} "
                             f"in the checkpoint; the model's is {tuple(shape)}")
        a, b = _range(e, d) if e is not None else (0, _numel(shape))
        reader.check(name, a, b)
        plan.append((name, t, e, a, b))
    states = []
    if optimizer is None:
        return plan, states
    o = m.get("optimizer")
    if o is None:
        raise ValueError(f"{where}: the checkpoint holds no optimizer state (saved without "
                         f"one); load it without the optimizer")
    names = _names(model)
    groups = o["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{where}: {len(groups)} parameter groups; the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for i, (g, group) in enumerate(zip(groups, optimizer.param_groups)):
        want = [names.get(id(p), p._zinf.name) for p in group["params"]]
        if g["params"] != want:
            raise ValueError(f"{where}: parameter group {i} holds {g['params'][:4]}..., the "
                             f"optimizer's {want[:4]}...")
        for p, name in zip(group["params"], want):
            e = p._zinf
            if not optimizer._mine(e):
                continue
            step = int(o["steps"].get(name, 0))
            a, b = _range(e, d)
            keys = []
            for key in _STATE:
                k = f"{name}:{key}"
                if not step or k not in tensors:
                    continue
                if key == "max_exp_avg_sq" and not g["amsgrad"] or \
                        key == "master" and not optimizer._wants_master(e):
                    continue
                if tuple(tensors[k]["shape"]) != e.shape:
                    raise ValueError(f"{where}: {k} has shape {tuple(tensors[k]['shape'])}; "
                                     f"the parameter's is {e.shape}")
                reader.check(k, a, b)
                keys.append(key)
            lack = [k for k in _STATE[:3 if g["amsgrad"] else 2] if k not in keys]
            if step and lack:
                raise ValueError(f"{where}: {name} took {step} steps but the checkpoint "
                                 f"holds no {name}:{lack[0]}")
            states.append((p, e, name, step, bool(g["amsgrad"]), keys, a, b))
    return plan, states


def _put(e, handle, values):
    """values (flat, e's elements from this rank's start) into e's float32 state handle,
    padded with zeros."""
    with e.owner._lock, e.owner.engine.fetch(handle, "host", dirty=True) as pin:
        with _disabled():
            v = view_as(pin, e.sshape, torch.float32).reshape(-1)
            v[values.numel():].zero_()
            v[:values.numel()].copy_(values)
            del v


def _apply(plan, states, model, optimizer, m, reader):
    for name, t, e, a, b in plan:
        v = reader.read(name, a, b)
        if e is None:
            with torch.no_grad(), _disabled():
                t.copy_(v.view(t.shape))
        elif e.owner.z3 is not None:
            with e.owner._lock:
                if e.pending is not None:
                    e.owner.ensure(e)
                e.owner.z3.write_slice(e.owner, e, v)
        else:
            e.owner.write(e, v.view(e.shape))
        del v
    if optimizer is None:
        return
    for g, group in zip(m["optimizer"]["param_groups"], optimizer.param_groups):
        for k, v in g.items():
            if k in ("params", "capturable", "differentiable"):
                continue
            if isinstance(group.get(k), torch.Tensor):
                group[k].fill_(v)
            else:
                group[k] = tuple(v) if isinstance(v, list) else v
    for p, e, name, step, amsgrad, keys, a, b in states:
        st = optimizer.state[p]
        if not step:
            st.pop("step", None)
            for h in (e.m, e.v, e.vmax):
                if h is not None:       # a step from here starts from zeros
                    _put(e, h, torch.zeros(0))
            continue
        optimizer._state_tensors(e, amsgrad)
        for key, h in zip(_STATE, (e.m, e.v, e.vmax, e.master)):
            if key in keys:
                _put(e, h, reader.read(f"{name}:{key}", a, b))
            elif key == "master" and h is not None:     # the parameter's values
                _put(e, h, _read_slice(e, e.handle, e.dtype, a, b).float())
        st["step"] = step


def _forget_grads(model):
    """Every gradient forgotten (set to None): a checkpoint holds none."""
    for off in {id(e.owner): e.owner for e in map(_entry, model.parameters())
                if e is not None}.values():
        with off._lock:
            for e in off._entries:
                off._sync_grad(e)
                off.forget_grad(e)
            off._unreduced = False
    for p in model.parameters():
        if _entry(p) is None:
            p.grad = None


def load_checkpoint(directory, model, optimizer=None):
    """Read a checkpoint save_checkpoint wrote into model (offloaded as it is now: alone, or
    on any number of ranks at any stage) and its zinf.torch.AdamW: each rank reads from the
    saved ranks' files exactly the ranges it holds now, re-cut where the ranks or the stage
    differ. Every rank calls it. Every name, shape, file and range is checked on every rank
    before any value is written: a missing or truncated file, or a checkpoint of another
    model, is an error naming the file and the tensor, on every rank, and changes nothing.
    The optimizer takes the checkpoint's hyper-parameters and step counts; the gradients
    are forgotten. Returns {"step", "extra", "world_size", "stage"} as saved."""
    d = group_of(model)
    _check_opt(optimizer, d)
    _settle(model)
    what = f"zinf.torch.load_checkpoint({directory!r})"
    with contextlib.ExitStack() as stack:
        err = m = reader = plan = states = None
        try:
            m = _read_manifest(directory)
            reader = _Reader(directory, m, stack)
            plan, states = _plan(model, optimizer, m, reader, d)
        except Exception as x:
            err = x
        agree(d, err, what)
        try:
            _apply(plan, states, model, optimizer, m, reader)
            _forget_grads(model)
        except Exception as x:
            err = RuntimeError(f"{what} failed after it began writing; the model and the "
                               f"optimizer hold a part of it: {x}")
            err.__cause__ = x
        agree(d, err, what)
    return {"step": m["step"], "extra": m["extra"], "world_size": m["world_size"],
            "stage": m["stage"]}
