"""ZeRO stage 3 of an Offload across a torch.distributed group (offload(..., stage=3)): each
rank's engine homes its 1/N flat slice of every parameter (and so of its gradient, moments
and master copy), padded with zeros to N equal slices; the full values exist only in torch
memory, gathered for a use and dropped after it.

What is here: the slices' layout (slice_of, valid), the gathers (a module's parameters in
one all_gather for its forward, one parameter for a saved view the backward unpacks, any
slice-shaped tensor for a reader: p.grad, state dicts), the backward's gradients bucketed,
averaged over the group and scattered to their slices (reduce_scatter where the backward
has it, else an all_reduce of the bucket of which each rank keeps its row), and the
exchange of the slices' 2-norms and finiteness that clip_grad_norm_ and GradScaler read.
What is not: the hooks that call these (Offload's, in _offload.py and _grads.py), the
update (zinf.torch.AdamW steps the slices as it steps whole tensors), overlap of the
collectives with compute (each is issued where its data is ready and waited for there),
and checkpoints (_io.py and _ckpt.py read and write the slices through range_of and
write_slice).

Every function that issues a collective is reached in the same order on every rank, as the
ranks run the same program over the same model: the forward's modules in their call order,
the backward's nodes in autograd's order, the readers where the program reads. Padding
never reaches a value users see: it is zeros in every slice-shaped tensor (a zero
gradient keeps AdamW's update of a zero parameter zero) and cut off every gathered one."""

import math

import torch

from ._views import _disabled, _numel, view_as

__all__ = ["Zero3", "BUCKET_BYTES"]

# The gradients the backward gathers into one collective, in float32 bytes of their full
# sizes: a bucket is sent once it holds this much (and at the backward's end whatever it
# holds).
BUCKET_BYTES = 25 << 20


class _Full:
    """A gathered parameter, standing where a fetched one has its Pinned (Offload's e.pin):
    the full padded tensor in torch memory, its address (ptr, by which saved tensors find
    their parameter) and the parameter's view of it; release() lets it go (the write-back
    of a dirty one is Offload's, through Zero3.write)."""

    __slots__ = ("flat", "view", "ptr", "dropped")

    def __init__(self, flat, shape):
        self.flat = flat
        self.view = flat[:_numel(shape)].view(shape)
        self.ptr = flat.untyped_storage().data_ptr()
        self.dropped = False

    def release(self, dirty=False):
        self.flat = self.view = None
        self.dropped = True


def _signature(ids):
    """Four small numbers that name a bucket's parameters (their indices in order): two
    hashes h (mod 251 and 241) and their squares. Summed over the ranks, sum(h) = N h and
    sum(h^2) = N h^2 hold only where every rank's h is this one's (their variance is 0),
    and every sum stays an integer a float32 holds exactly (up to 2^24, past 250 ranks)."""
    out = []
    for m in (251, 241):
        h = 1 + sum((i + 1) * (j + 1) for j, i in enumerate(ids)) % m
        out += [float(h), float(h * h)]
    return out


class Zero3:
    """One Offload's stage 3 over a Group (_dist.Group): its rank, size and counts."""

    def __init__(self, group, bucket_bytes):
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"zinf.torch.offload: bucket_bytes={bucket_bytes!r}; give a "
                             f"positive count of bytes")
        self.g = group
        self.dist = group.dist
        self.rank, self.size = group.rank, group.size
        self.bucket_bytes = bucket_bytes
        backend = str(self.dist.get_backend(group.group)).lower()
        # NCCL has the tensor forms; gloo has neither reduce_scatter nor (in every torch)
        # all_gather_into_tensor.
        self.tensor_forms = backend == "nccl"
        self.bucket = []        # (entry, gradient) the backward gave since the last send
        self.bucket_size = 0    # their bytes as float32
        self.local = {}         # id(entry) -> entry whose gnorm is this rank's slice's only
        self.grads = {}         # id(entry) -> its full gradient gathered (unscaled), cached
        self.gathers = 0        # all_gather collectives issued, for the tests and the curious
        self.reductions = 0     # gradient buckets reduced (one collective each)

    # ---- layout -------------------------------------------------------------------------

    def slice_len(self, shape):
        """The elements of each rank's slice of a parameter of this shape (at least 1)."""
        return max(1, -(-_numel(shape) // self.size))

    def valid(self, e):
        """How many elements of this rank's slice of e are e's, not padding."""
        s = e.sshape[0]
        return max(0, min(s, _numel(e.shape) - self.rank * s))

    def slice_of(self, values, e):
        """This rank's slice of values (e's full shape, any dtype and device): a new CPU
        tensor of e.sshape, padded with zeros."""
        s = e.sshape[0]
        flat = values.detach().reshape(-1)
        out = torch.zeros(s, dtype=values.dtype)
        k = self.valid(e)
        if k:
            out[:k].copy_(flat[self.rank * s:self.rank * s + k])
        return out

    # ---- gathers ------------------------------------------------------------------------

    def _all_gather(self, out, mine):
        """out (size * len(mine), contiguous) := every rank's mine in rank order."""
        self.gathers += 1
        if self.tensor_forms:
            self.dist.all_gather_into_tensor(out, mine, group=self.g.group)
        else:
            self.dist.all_gather(list(out.view(self.size, -1).unbind(0)), mine,
                                 group=self.g.group)

    def gather(self, off, entries, tier):
        """The entries' parameters gathered for a use, one collective for all (their slices'
        bytes side by side): a _Full each, on the device of the tier's copies."""
        pins = off.engine.fetch_all([e.handle for e in entries], tier, **off._fetch_kw)
        try:
            with _disabled():
                parts = [view_as(pin, e.sshape, e.dtype).view(torch.uint8)
                         for pin, e in zip(pins, entries)]
                mine = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
                del parts
        finally:
            for pin in pins:
                pin.release()
        with _disabled():
            every = torch.empty(self.size * mine.numel(), dtype=torch.uint8,
                                device=mine.device)
            self._all_gather(every, mine)
            rows = every.view(self.size, -1)
            out, at = [], 0
            for e in entries:
                nb = e.sshape[0] * e.dtype.itemsize
                flat = rows[:, at:at + nb].reshape(-1).view(e.dtype)
                at += nb
                out.append(_Full(flat, e.shape))
        return out

    def full_of(self, off, e, handle, dtype=torch.float32):
        """Any slice-shaped tensor of e (its gradient, a moment) gathered: a CPU tensor of
        e's full shape."""
        with off.engine.fetch(handle, "host") as pin:
            with _disabled():
                mine = view_as(pin, e.sshape, dtype).clone()
        with _disabled():
            every = torch.empty(self.size * mine.numel(), dtype=dtype)
            self._all_gather(every, mine)
            return every[:_numel(e.shape)].view(e.shape)

    def full_grad(self, off, e):
        """e's full gradient, the mean over the group, with its pending scale: gathered at
        the first read after a change (a backward, zeros, a clamp, a write) and cached."""
        g = self.grads.get(id(e))
        if g is None:
            g = self.grads[id(e)] = self.full_of(off, e, off.grad_handle(e))
        if e.gscale != 1.0:
            with _disabled():
                return g * e.gscale
        return g

    def range_of(self, e):
        """The flat range [a, b) of e's full values that this rank's slice holds (empty
        where the slice is all padding)."""
        a = min(self.rank * e.sshape[0], _numel(e.shape))
        return a, a + self.valid(e)

    def write(self, off, e, values):
        """This rank's slice of values (e's full shape) into e's parameter in zinf, and into
        its float32 master copy where it has one."""
        a, b = self.range_of(e)
        self.write_slice(off, e, values.detach().reshape(-1)[a:b])

    def write_slice(self, off, e, part):
        """part (e's full values in range_of(e), flat, any dtype) into this rank's slice of
        e's parameter in zinf, padded with zeros, and into its float32 master copy where it
        has one."""
        with _disabled():
            # In the values' dtype: the master copy takes them unrounded.
            mine = torch.zeros(e.sshape[0], dtype=part.dtype)
            mine[:part.numel()].copy_(part)
            with off.engine.fetch(e.handle, "host", dirty=True) as pin:
                view_as(pin, e.sshape, e.dtype).copy_(mine)
            if e.master is not None:
                with off.engine.fetch(e.master, "host", dirty=True) as pin:
                    view_as(pin, e.sshape, torch.float32).copy_(mine)

    def put_grad(self, off, e, full):
        """This rank's slice of full (e's full gradient, its scale applied) into e's
        gradient in zinf."""
        with _disabled():
            mine = self.slice_of(full.float(), e)
            with off.engine.fetch(off.grad_handle(e), "host", dirty=True) as pin:
                view_as(pin, e.sshape, torch.float32).copy_(mine)
                off._note_grad(e, pin)
        self.changed(e)

    # ---- gradients ----------------------------------------------------------------------

    def add_grad(self, off, e, g):
        """A gradient the backward made (e's full shape): into the bucket, sent once the
        bucket is full (the rest at the backward's end, Offload._end_of_backward)."""
        self.bucket.append((e, g.detach()))
        self.bucket_size += 4 * g.numel()
        off._queue_end_of_backward()
        if self.bucket_size >= self.bucket_bytes:
            self.flush(off)

    def flush(self, off):
        """The bucket's gradients summed over the group and divided by its size, each rank
        adding its slice of each into its gradient in zinf. The bucket is a (size, k + 4)
        float32 matrix whose row r holds rank r's slices side by side, and four columns that
        name the bucket's parameters (_signature): a rank whose backward gave other
        gradients than another's is an error on every rank, not a sum of unrelated
        values."""
        items, self.bucket, self.bucket_size = self.bucket, [], 0
        if not items:
            return
        n = self.size
        index = {id(x): i + 1 for i, x in enumerate(off._entries)}
        k = sum(e.sshape[0] for e, _ in items)
        with _disabled():
            dev = items[0][1].device
            rows = torch.zeros(n, k + 4, dtype=torch.float32, device=dev)
            at = 0
            for e, g in items:
                s, flat = e.sshape[0], g.reshape(-1)
                for r in range(n):
                    a, b = r * s, min((r + 1) * s, flat.numel())
                    if a < b:
                        rows[r, at:at + b - a].copy_(flat[a:b])
                at += s
            sig = _signature([index[id(e)] for e, _ in items])
            rows[:, k:] = torch.tensor(sig, dtype=torch.float32)
            self.reductions += 1
            if self.tensor_forms:
                mine = torch.empty(k + 4, dtype=torch.float32, device=dev)
                self.dist.reduce_scatter_tensor(mine, rows.view(-1), group=self.g.group)
            else:
                self.dist.all_reduce(rows, group=self.g.group)
                mine = rows[self.rank]
            if mine[k:].double().tolist() != [n * x for x in sig]:
                raise RuntimeError(
                    "zinf.torch: stage 3's gradients: the ranks' backwards gave gradients "
                    "of other parameters (each rank's backward must reach the same "
                    "parameters, in the same order, as the same program over the same "
                    "model does)")
            mine = torch.div(mine[:k], n).to("cpu").contiguous()
        at = 0
        with off._lock:
            for e, _ in items:
                s = e.sshape[0]
                part = mine[at:at + s]
                at += s
                fresh = not e.has_grad or e.fresh
                sumsq = off.engine._grad_add(off.grad_handle(e), part.data_ptr(), s, 0,
                                             e.gscale, fresh)
                e.gnorm = math.sqrt(sumsq)
                e.nonfinite = not math.isfinite(sumsq)
                e.gscale = 1.0
                e.has_grad, e.fresh = True, False
                self.local[id(e)] = e
                self.grads.pop(id(e), None)
                if e.view is None and not e.standing:
                    off._put_proxy(e)

    def changed(self, e):
        """e's gradient slice changed here (zeros, a clamp, a write): its cached full copy
        is stale and its norm, where it has one, this slice's own."""
        self.grads.pop(id(e), None)
        # Whatever this rank's slice holds: the set exchanged must be the same on every
        # rank, which its values are not.
        self.local[id(e)] = e

    def exchange(self, off):
        """The 2-norms and finiteness the slices gave, made the full gradients' on every
        rank: one all_reduce of the squares and flags, in the parameters' order."""
        if not self.local:
            return
        ents = [e for e in off._entries if id(e) in self.local]
        self.local = {}
        m = len(ents)
        v = torch.zeros(2 * m, dtype=torch.float64)
        for i, e in enumerate(ents):
            v[i] = e.gnorm * e.gnorm if e.gnorm is not None else 0.0
            v[m + i] = float(e.nonfinite)
        self.dist.all_reduce(v, group=self.g.group)
        for i, e in enumerate(ents):
            x = v[i].item()
            e.gnorm = math.sqrt(x) if math.isfinite(x) else math.inf
            e.nonfinite = bool(v[m + i].item())

    def zero_pad(self, e, v):
        """The padding of this rank's slice view v made zeros again (after a clamp)."""
        k = self.valid(e)
        if k < v.numel():
            v[k:].zero_()

    def forget(self):
        """A backward that raised: the gradients it left in the bucket go (they are a part
        of a backward), as the rest of such a backward's."""
        self.bucket, self.bucket_size = [], 0
