"""Data parallelism over a torch.distributed process group: each rank's Offload
(offload(..., group=, stage=1, 2 or 3)), its gradients made the mean over the group once
per optimizer step (Group.reduce, in buckets of bucket_bytes: one all_reduce each), and
which rank owns each parameter's AdamW update (owner_of). Stage 2 keeps each gradient on
its owner alone; the others forget theirs and keep its 2-norm (and whether it is finite),
exchanged, for clipping and GradScaler. Stage 3 (the parameters partitioned too) is
_zero3.py's: there each rank homes a slice of every tensor, the backward reduces the
gradients in buckets, and Group only checks the ranks' start and holds the group.

What this is not: a reduction at stages 1 and 2 overlapped with the backward (it runs after
it, at the first read, each rank holding every gradient until then), overlap of stage 3's
collectives with compute, or checkpoints (_ckpt.py's). Every collective here is issued in
the same order on every rank, as the ranks run the same program over the same model: the
parameters in their registration order, cut into the same buckets."""

import math

import torch

from ._views import _disabled, _numel, view_as

__all__ = ["Group", "make_group", "owner_of"]

STAGES = (1, 2, 3)


def make_group(group, stage, bucket_bytes):
    """offload()'s group, stage and bucket_bytes checked: None without a group, else the
    Group (stage None with a group is 3, as DeepSpeed's zero_optimization takes it)."""
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or \
            bucket_bytes <= 0:
        raise ValueError(f"zinf.torch.offload: bucket_bytes={bucket_bytes!r}; give a "
                         f"positive count of bytes")
    if group is None:
        if stage is not None:
            raise ValueError(f"zinf.torch.offload: stage={stage} partitions across the "
                             f"ranks of a group; give group= (a torch.distributed "
                             f"ProcessGroup) with it")
        return None
    stage = 3 if stage is None else stage
    if stage not in STAGES:
        raise ValueError(f"zinf.torch.offload: stage={stage!r}; across ranks zinf.torch "
                         f"runs stage=1 (the optimizer states partitioned), stage=2 (the "
                         f"gradients too) or stage=3 (the parameters too, the default)")
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("zinf.torch.offload: group= needs torch.distributed initialised "
                           "(dist.init_process_group) first")
    return Group(group, stage, bucket_bytes)


class Group:
    """The process group an Offload's gradients are averaged over, and its ZeRO stage."""

    def __init__(self, group, stage, bucket_bytes):
        import torch.distributed as dist
        self.dist = dist
        self.group, self.stage = group, stage
        self.bucket_bytes = bucket_bytes
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.reductions = 0     # gradients reduced, for the tests and the curious
        self.collectives = 0    # buckets reduced at stages 1 and 2 (one all_reduce each)
        # Stage 2: id(entry) -> the rank that owns its update (AdamW's split, which it puts
        # here); the entries whose gradient lies on their owner only (remote: this rank
        # keeps its 2-norm and finiteness); and the owned ones that hold the reduced mean,
        # which a further backward scales by the group's size before it adds its own, so
        # that the next reduction's mean keeps it whole.
        self.owners = {}
        self.remote = set()
        self.held = set()

    def is_remote(self, e):
        return id(e) in self.remote

    def forget(self, e):
        """e's gradient gone or zeros here (zero_grad)."""
        self.remote.discard(id(e))
        self.held.discard(id(e))

    def accumulate_scale(self, e):
        """The factor a backward multiplies what e's gradient holds by, before it adds its
        own: the group's size where it holds the reduced mean (stage 2's owner)."""
        self.remote.discard(id(e))
        if id(e) in self.held:
            self.held.discard(id(e))
            return float(self.size)
        return 1.0

    def _root(self, r):
        return self.dist.get_global_rank(self.group, r) if self.group is not None else r

    def check_same(self, params):
        """The ranks hold the same parameters (their count, shapes and values), as data
        parallelism needs: params, (name, shape, a function giving its values) in order;
        each one's sum and sum of squares (float64) and its shape's rank and sum compared
        by their extremes over the group. A rank that differs is an error on every rank,
        naming the first parameter found to differ."""
        dist = self.dist
        params = list(params)
        sig = []
        for name, shape, values in params:
            v = values().double()
            sig += [v.sum().item(), v.square().sum().item(), float(len(shape)),
                    float(sum(shape))]
        sig = torch.tensor([float(len(params))] + sig, dtype=torch.float64)
        # The count first: ranks with other models hold vectors of other lengths.
        n = sig[:1].clone()
        lo = n.clone()
        dist.all_reduce(n, dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(lo, dist.ReduceOp.MIN, group=self.group)
        if n.item() != lo.item():
            raise ValueError(f"zinf.torch.offload: the ranks offload models of "
                             f"{int(lo.item())} to {int(n.item())} parameters; data "
                             f"parallelism needs the same model on every rank")
        hi, lo = sig.clone(), -sig
        dist.all_reduce(hi, dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(lo, dist.ReduceOp.MAX, group=self.group)
        bad = (hi != -lo).nonzero()
        if len(bad):
            name = params[(int(bad[0].item()) - 1) // 4][0]
            raise ValueError(f"zinf.torch.offload: parameter {name} differs across the "
                             f"ranks of the group; data parallelism starts every rank from "
                             f"the same values (seed the model's initialisation alike, or "
                             f"load the same weights before offloading)")

    def reduce(self, off):
        """Every gradient of off made the mean over the group, where the backward left it
        unreduced: in buckets of bucket_bytes (float32 bytes), each the gradients side by
        side in the parameters' order (with their pending scales applied), summed over the
        group in one all_reduce and divided by its size. Stage 1 keeps every mean; stage 2
        keeps those of the parameters this rank owns (where AdamW gave it them) and forgets
        the rest. A parameter with a gradient on some rank and none on another gets zeros
        on the latter, so that the next step moves it on every rank, as it does where it
        has one."""
        if not off._unreduced:
            return
        dist = self.dist
        entries = off._entries
        # Which gradients to reduce: has one (1) and holds values since zero_grad (2),
        # taken as the largest over the group, so that every rank cuts the same buckets.
        flags = torch.tensor([(e.has_grad and 1) + (e.has_grad and not e.fresh and 1)
                              for e in entries], dtype=torch.int32)
        if len(flags):
            dist.all_reduce(flags, dist.ReduceOp.MAX, group=self.group)
        work = []
        for e, f in zip(entries, flags.tolist()):
            if f == 0:
                continue
            if not e.has_grad:
                off.grad_zero(e)
            if f < 2:
                continue        # zeros on every rank
            if e.pending is not None:
                off.ensure(e)
            work.append(e)
        parted = []             # stage 2: the entries reduced to their owner
        bucket, size = [], 0
        for i, e in enumerate(work):
            bucket.append(e)
            size += 4 * _numel(e.shape)
            if size >= self.bucket_bytes or i == len(work) - 1:
                parted += self._reduce_bucket(off, bucket)
                bucket, size = [], 0
        if parted:
            self._exchange_norms(parted)
        off._unreduced = False

    def _reduce_bucket(self, off, bucket):
        """One bucket of gradients summed over the group (one all_reduce of their float32
        values side by side) and divided by its size, each written back where this rank
        keeps it. Returns the entries stage 2 reduced to their owner."""
        dist = self.dist
        flat = torch.empty(sum(_numel(e.shape) for e in bucket), dtype=torch.float32)
        at = 0
        for e in bucket:
            n = _numel(e.shape)
            if e.fresh:
                flat[at:at + n].zero_()
            else:
                with off.engine.fetch(off.grad_handle(e), "host") as pin:
                    with _disabled():
                        torch.mul(view_as(pin, (n,), torch.float32), e.gscale,
                                  out=flat[at:at + n])
            at += n
        self.collectives += 1
        dist.all_reduce(flat, dist.ReduceOp.SUM, group=self.group)
        flat.div_(self.size)
        parted, at = [], 0
        for e in bucket:
            n = _numel(e.shape)
            owner = self.owners.get(id(e)) if self.stage == 2 else None
            if owner is None or owner == self.rank:
                with off.engine.fetch(off.grad_handle(e), "host", dirty=True) as pin:
                    with _disabled():
                        view_as(pin, (n,), torch.float32).copy_(flat[at:at + n])
                    off._note_grad(e, pin)
            at += n
            e.has_grad, e.fresh, e.gscale = True, False, 1.0
            if owner is not None:
                parted.append(e)
                if owner == self.rank:
                    self.held.add(id(e))
                else:
                    # Not this rank's: forgotten here (zeros where it lies, the next
                    # backward overwrites), its norm and finiteness to come.
                    off._zero_grad_data(e)
                    e.fresh = True
                    self.remote.add(id(e))
            off._put_proxy(e)
            self.reductions += 1
        return parted

    def _exchange_norms(self, parted):
        """Each owner's 2-norm and finiteness of the gradients reduced to it, to every rank:
        one all-reduce (sum) of their squares and flags in the parameters' order, each
        element from its owner alone, so every rank takes the same bits."""
        dist = self.dist
        n = len(parted)
        v = torch.zeros(2 * n, dtype=torch.float64)
        for i, e in enumerate(parted):
            if self.owners[id(e)] == self.rank:
                v[i] = e.gnorm * e.gnorm if e.gnorm is not None else 0.0
                v[n + i] = float(e.nonfinite)
        dist.all_reduce(v, dist.ReduceOp.SUM, group=self.group)
        for i, e in enumerate(parted):
            e.gnorm = math.sqrt(v[i].item()) if math.isfinite(v[i].item()) else math.inf
            e.nonfinite = bool(v[n + i].item())

    def broadcast(self, off, e, src):
        """e's values (the parameter in its dtype, as the owner's update left them) from the
        group's rank src into every other rank's engine."""
        dist = self.dist
        with off._lock:
            mine = self.rank == src
            with off.engine.fetch(e.handle, "host", dirty=not mine) as pin:
                with _disabled():
                    v = view_as(pin, e.shape, e.dtype)
                    s = v.clone() if mine else torch.empty_like(v)   # as in reduce()
                    dist.broadcast(s, self._root(src), group=self.group)
                    if not mine:
                        v.copy_(s)
                del v, s


def owner_of(sizes, ranks, loads=None):
    """Each parameter's owner (its update and optimizer state): greedy by size in the
    parameters' order, each to the rank that owns the fewest elements so far (the lowest
    rank on a tie), so that every rank computes the same split. loads: the elements each
    rank owns already (updated in place)."""
    loads = [0] * ranks if loads is None else loads
    out = []
    for n in sizes:
        r = min(range(ranks), key=lambda i: (loads[i], i))
        loads[r] += n
        out.append(r)
    return out

