"""save() and load(): Hugging Face safetensors checkpoints, one tensor in memory at a time.

Across ranks (a model offloaded with group=) every rank calls both: save() gathers each
parameter in turn where the ranks hold slices (stage 3) and rank 0 alone writes the files;
load() has every rank read what it holds (at stage 3 only the rows around its slice of each
tensor). What is not here: a training checkpoint with the optimizer's state, written by
every rank and loaded on another number of ranks (_ckpt.py's)."""

import json
import os
import re

import torch

from ._views import _disabled, _numel

__all__ = ["save", "load", "group_of", "agree", "read_flat"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _size(s):
    if isinstance(s, int):
        return s
    s = str(s).strip().upper()
    for unit, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10 ** 9),
                       ("MB", 10 ** 6), ("KB", 10 ** 3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def _items(model):
    """(name, tensor or parameter) for what a checkpoint holds: each parameter once (its
    first name, as named_parameters() gives it: a tied alias is left to the model's tying)
    and the persistent buffers."""
    out = [(n, p) for n, p in model.named_parameters()]
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                out.append((f"{mname}.{bname}" if mname else bname, b))
    return out


def _shape_dtype(t):
    e = t.__dict__.get("_zinf") if isinstance(t, torch.nn.Parameter) else None
    return (e.shape, e.dtype) if e is not None else (tuple(t.shape), t.dtype)


def _value(t):
    e = t.__dict__.get("_zinf") if isinstance(t, torch.nn.Parameter) else None
    if e is not None:
        return e.owner.read(e)
    with _disabled():
        return t.detach().to("cpu").contiguous()


def group_of(model):
    """The Group (_dist.py) the model's offloaded parameters are partitioned over, or None
    where they are offloaded without one (or not at all): one for all."""
    found = None
    for name, p in model.named_parameters():
        e = p.__dict__.get("_zinf")
        d = e.owner.dist if e is not None else None
        if found is None:
            found = d
        elif d is None or d.group is not found.group:
            raise ValueError(f"zinf.torch: parameter {name} is offloaded "
                             f"{'without a group' if d is None else 'with another group'} "
                             f"than the model's others; a checkpoint is of one group")
    return found


def agree(d, err, what):
    """Every rank learns whether any rank failed (err: this rank's exception or None): an
    all-reduce that is also the barrier the ranks leave together. Raises on every rank where
    one failed, this rank's own error where it has one."""
    if d is None:
        if err is not None:
            raise err
        return
    flag = torch.tensor([0 if err is None else d.rank + 1], dtype=torch.int64)
    d.dist.all_reduce(flag, d.dist.ReduceOp.MAX, group=d.group)
    if err is not None:
        raise err
    if flag.item():
        raise RuntimeError(f"{what}: rank {flag.item() - 1} of the group failed (its "
                           f"error is raised there)")


def save(model, directory, *, max_shard_size="5GB", config=True):
    """Write model's parameters and persistent buffers as Hugging Face safetensors into
    directory: one model.safetensors, or shards model-0000k-of-0000n.safetensors with
    model.safetensors.index.json when they pass max_shard_size. Offloaded parameters are
    read from zinf one at a time, so memory holds one shard at most. A Hugging Face model's
    config (and generation config) goes beside them (config=False: not), so that
    from_pretrained(directory) loads it. Works on any module, offloaded or not.

    Across ranks (offload(..., group=)) every rank calls it: at stage 3 each parameter is
    gathered in turn (a collective), at stages 1 and 2 rank 0 reads its own copy, and rank 0
    alone writes the files. Every rank returns once they are complete (an error of rank 0's
    is raised there and named on the others)."""
    from safetensors.torch import save_file

    limit = _size(max_shard_size)
    d = group_of(model)
    writer = d is None or d.rank == 0
    # Stage 3's parameters are gathered on every rank (collectives), in the same order.
    gather = d is not None and d.stage == 3
    items = _items(model)
    shards, cur, cur_bytes = [], [], 0
    for name, t in items:
        shape, dtype = _shape_dtype(t)
        n = _numel(shape) * dtype.itemsize
        if cur and cur_bytes + n > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, t))
        cur_bytes += n
    if cur or not shards:
        shards.append(cur)
    names = [_SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    err = None
    if writer:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as x:
            err = x
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        tensors = {}
        for name, t in shard:
            offloaded = isinstance(t, torch.nn.Parameter) and "_zinf" in t.__dict__
            if writer or gather and offloaded:
                value = _value(t)
            if not writer:
                continue
            tensors[name] = value
            total += value.numel() * value.element_size()
            weight_map[name] = fname
            del value
        if writer and err is None:
            try:
                tmp = os.path.join(directory, fname + ".tmp")
                save_file(tensors, tmp, metadata={"format": "pt"})
                os.replace(tmp, os.path.join(directory, fname))
            except Exception as x:      # the others go on gathering: told at the end
                err = x
        del tensors
    if writer and err is None:
        try:
            _finish(model, directory, names, weight_map, total, config)
        except Exception as x:
            err = x
    # Every rank returns once the files are complete, or raises where rank 0 failed.
    agree(d, err, f"zinf.torch.save({directory!r})")


def _finish(model, directory, names, weight_map, total, config):
    """save()'s last writes: an earlier save's shards that this one did not write removed,
    the index (or none), the config."""
    # Shards of an earlier save that this one did not write would be read with it.
    for old in os.listdir(directory):
        if old not in names and (old == _SINGLE or re.fullmatch(
                r"model-\d{5}-of-\d{5}\.safetensors", old)):
            os.remove(os.path.join(directory, old))
    if len(names) > 1:
        with open(os.path.join(directory, _INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)
    elif os.path.exists(os.path.join(directory, _INDEX)):
        os.remove(os.path.join(directory, _INDEX))
    if config:
        for attr in ("config", "generation_config"):
            c = getattr(model, attr, None)
            if c is not None and callable(getattr(c, "save_pretrained", None)):
                c.save_pretrained(directory)


def _files(path):
    """{key: file} of a checkpoint: a .safetensors file, or a directory with one or with a
    sharded index."""
    from safetensors import safe_open

    if os.path.isdir(path):
        index = os.path.join(path, _INDEX)
        if os.path.exists(index):
            with open(index) as f:
                wm = json.load(f)["weight_map"]
            return {k: os.path.join(path, v) for k, v in wm.items()}
        single = os.path.join(path, _SINGLE)
        if not os.path.exists(single):
            raise FileNotFoundError(f"{path}: neither {_SINGLE} nor {_INDEX}")
        path = single
    with safe_open(path, "pt") as f:
        return {k: path for k in f.keys()}


def read_flat(sl, shape, a, b):
    """Elements [a, b) of a tensor of this shape, flat, from its safetensors slice sl: the
    rows (along the first dimension) that hold them are read, not the whole tensor."""
    if b <= a:
        return torch.empty(0)
    if len(shape) == 0:
        return sl[...].reshape(-1)[a:b]
    row = _numel(shape[1:])
    r0, r1 = a // row, -(-b // row)
    return sl[r0:r1].reshape(-1)[a - r0 * row:b - r0 * row]


def load(model, path, *, strict=True):
    """Read a safetensors checkpoint (a file, or a directory with model.safetensors or a
    sharded model.safetensors.index.json, as save() or save_pretrained() write them) into
    model: each tensor is read and written into zinf (or into a parameter or buffer kept
    in memory) one at a time, converted to the parameter's dtype; a 16-bit parameter's
    float32 master copy gets the values too. Every name and shape is checked before any
    value is written: a mismatch is an error naming it, and changes nothing. A key the
    model's names lack is tried under its base_model_prefix (a base model's checkpoint).
    strict: every parameter and persistent buffer must be given (a tied alias counts as
    its twin), and every key taken. Returns (missing, unexpected). Across ranks every rank
    calls it and reads what it holds: the whole tensors at stages 1 and 2, at stage 3 the
    rows around its slice of each."""
    from safetensors import safe_open

    files = _files(path)
    targets = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        targets[name] = p
    for name, b in _items(model):
        targets.setdefault(name, b)
    prefix = getattr(model, "base_model_prefix", "") or ""
    plan, unexpected = [], []
    for key, fname in files.items():
        name = key if key in targets else f"{prefix}.{key}" if prefix and \
            f"{prefix}.{key}" in targets else None
        if name is None:
            unexpected.append(key)
            continue
        plan.append((key, fname, name))
    by_file = {}
    for key, fname, name in plan:
        by_file.setdefault(fname, []).append((key, name))
    for fname, keys in by_file.items():
        with safe_open(fname, "pt") as f:
            for key, name in keys:
                shape = tuple(f.get_slice(key).get_shape())
                want, _ = _shape_dtype(targets[name])
                if shape != tuple(want):
                    raise ValueError(f"{fname}: {key} has shape {shape}; the model's {name} "
                                     f"is {tuple(want)}")
    loaded = {id(targets[name]) for _, _, name in plan}
    missing = [n for n, t in _items(model) if id(t) not in loaded]
    if strict and (missing or unexpected):
        raise KeyError(f"{path}: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                       f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for fname, keys in by_file.items():
        with safe_open(fname, "pt") as f:
            for key, name in keys:
                t = targets[name]
                e = t.__dict__.get("_zinf") if isinstance(t, torch.nn.Parameter) else None
                z3 = e.owner.z3 if e is not None else None
                if z3 is not None:      # this rank's slice alone, read as rows around it
                    a, b = z3.range_of(e)
                    part = read_flat(f.get_slice(key), e.shape, a, b)
                    with e.owner._lock:
                        if e.pending is not None:
                            e.owner.ensure(e)
                        z3.write_slice(e.owner, e, part)
                    del part
                    continue
                value = f.get_tensor(key)
                if e is not None:
                    e.owner.write(e, value)
                else:
                    with torch.no_grad(), _disabled():
                        t.copy_(value)
                del value
    return missing, unexpected
