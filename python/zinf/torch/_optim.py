"""zinf.torch.AdamW: torch.optim.AdamW over parameters whose state lives in zinf."""

import math
import weakref

import torch

from .. import Error, adamw_step
from ._dist import owner_of
from ._param import OffloadedError
from ._views import _numel, page_round, view_as

__all__ = ["AdamW"]

_disabled = torch._C.DisableTorchFunctionSubclass
_SIXTEEN = (torch.bfloat16, torch.float16)
# AdamW's default overlap_min: with overlap, parameters of fewer elements (a state under
# 1 MiB) are updated inside step().
OVERLAP_MIN = 1 << 16


def _f(x):
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW for offloaded parameters: the same arguments, parameter groups,
    defaults and update, with parameter, gradient and moments streamed through the engine
    and stepped on the host (libzinf's SIMD AdamW; amsgrad in torch's arithmetic).

    The moments are zinf tensors "<name>.exp_avg", "<name>.exp_avg_sq" (and
    "<name>.max_exp_avg_sq" with amsgrad), float32, homed with the parameter. A bf16 or fp16
    parameter gets a float32 master copy "<name>.master" (master_dtype=torch.float32, the
    default for them): the update runs on the master and the parameter the forward fetches
    is its rounding; master_dtype=None updates the 16-bit values themselves (in float32
    arithmetic, rounded back each step). Parameters without a gradient since zero_grad()
    are skipped, as torch skips a None .grad.

    state_dict() holds the moments in torch.optim.AdamW's layout (float32, read into
    memory), and load_state_dict() takes torch's: state converts both ways. foreach and
    fused are taken and change nothing (the update is libzinf's); capturable and
    differentiable are refused.

    overlap=True (the default): step() takes each parameter's update (its arguments as they
    stand: lr, betas, the gradient's scale) and returns; the update itself runs at the
    parameter's next use, as the next forward fetches it, with the next ones' state
    prefetched meanwhile, so that the drive reads and writes the update's state while the
    forward computes instead of while the trainer waits. Whatever reads or overwrites what
    an update reads or writes first carries it out: the forward and backward, state_dict()
    and load_state_dict() of the model or of this optimizer, zinf.torch.gathered, save and
    load, the next step(), and Engine.flush() and close(). zero_grad() is taken at once and
    its zeros written once the update has read the gradient. overlap=False updates every
    parameter inside step(). Parameters of fewer than overlap_min elements (default
    OVERLAP_MIN, 65536: a state under 1 MiB, whose reads hide too little to pay for the hook)
    are updated inside step() either way.

    A step is a unit: where it is interrupted (an exception, KeyboardInterrupt) after some
    parameters took their update and before the rest did, every engine it steps is closed
    without a flush (Engine.close_unflushed), so that what is saved is the last whole
    step's, never a mix; the exception goes on to the caller (with overlap, the caller of
    whatever carried out the update that failed).

    Across ranks (parameters offloaded with group= and stage=1 or 2): each parameter is owned
    by one rank of the group, greedily by size in the parameters' order (the same split on
    every rank); only the owner registers its moments (and master copy) and updates it, then
    broadcasts its new values to the group, and every rank writes them into its engine.
    step() first has the gradients averaged over the group where a backward left them
    unreduced. It carries out every update and broadcast itself, as overlap=False does,
    whatever overlap says: the broadcasts are collectives, which must come in the same order
    on every rank, and the next forward's fetches do not promise one. state_dict() holds
    this rank's parameters' state only. With stage=2 the split also says which rank each
    gradient is reduced to. With stage=3 every rank steps its slice of every parameter
    (moments slice-sized), with no broadcast: the next forward gathers the new values;
    state_dict() then wants gather= (see it)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_dtype="auto", overlap=True,
                 overlap_min=None):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not _f(lr) >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps > 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= _f(betas[0]) < 1.0 or not 0.0 <= _f(betas[1]) < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if capturable:
            raise ValueError("zinf.torch.AdamW: capturable=True is not offered (the update "
                             "runs on the host, outside any CUDA graph)")
        if differentiable:
            raise ValueError("zinf.torch.AdamW: differentiable=True is not offered (the "
                             "update runs in libzinf, outside autograd)")
        if master_dtype not in ("auto", None, torch.float32):
            raise ValueError(f"zinf.torch.AdamW: master_dtype {master_dtype} is not offered: "
                             f"torch.float32, None or \"auto\"")
        self.master_dtype = master_dtype
        self.overlap = bool(overlap)
        self.overlap_min = OVERLAP_MIN if overlap_min is None else int(overlap_min)
        self._queue = []          # entries whose update step() deferred, in the forward's order
        self._next = 0            # the first of them that may still be pending
        self._engines = {}        # the engines the deferred step updates
        self._applied = 0         # updates of the deferred step carried out
        self._barriers = {}       # id(engine) -> engine that runs _settle before a flush
        # Across ranks (offload(..., group=, stage=1 or 2)): the group, each parameter's
        # owner (id of its entry -> rank in the group) and the elements each rank owns.
        self._dist = None
        self._owner = {}
        self._loads = None
        # Whether any rank may hold optimizer state: set by a step or a load, the same on
        # every rank (they step together). Until then a plain state_dict() across ranks is
        # whole (no state anywhere) and is given, as accelerate asks for it when it wraps.
        self._has_state = False
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=False, differentiable=False, fused=fused)
        super().__init__(params, defaults)

    # ---- groups and state -------------------------------------------------------------------

    def add_param_group(self, param_group):
        """torch's, for offloaded parameters; each parameter's moments (and master copy) are
        made now, so that a group added between steps steps as the first ones do."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if p.__dict__.get("_zinf") is None:
                raise ValueError("zinf.torch.AdamW steps offloaded parameters only "
                                 "(zinf.torch.offload the module first)")
        self._take_group(params)
        for p in params:
            e = p._zinf
            room = e.owner.engine.stats()["tier"][1]["capacity_bytes"]
            need = self._step_bytes(e, param_group.get("amsgrad", self.defaults["amsgrad"]))
            if need > room:
                raise ValueError(f"{e.name}: its parameter, gradient and moments take "
                                 f"{need} bytes; the host tier holds {room}, and a step "
                                 f"needs them at once")
        super().add_param_group(param_group)
        for p in params:
            if self._mine(p._zinf):
                self._state_tensors(p._zinf, self.param_groups[-1]["amsgrad"])

    def _take_group(self, params):
        """The group the parameters' offloads average over (one for all, or none), and the
        owner of each new parameter's update."""
        for p in params:
            d = p._zinf.owner.dist
            if self._dist is None and d is not None and not self._owner and \
                    not self.param_groups:
                self._dist, self.overlap = d, False
                self._loads = [0] * d.size
            if d is not self._dist and (d is None or self._dist is None or
                                        d.group is not self._dist.group):
                raise ValueError(f"zinf.torch.AdamW: {p._zinf.name} is offloaded "
                                 f"{'without a group' if d is None else 'with another group'}"
                                 f"; one optimizer steps the parameters of one group")
        if self._dist is None:
            return
        new = list(dict.fromkeys(p._zinf for p in params if id(p._zinf) not in self._owner))
        for e, r in zip(new, owner_of([_numel(e.shape) for e in new], self._dist.size,
                                      self._loads)):
            self._owner[id(e)] = r
            e.owner.dist.owners[id(e)] = r      # stage 2 reduces its gradient to r

    def _mine(self, e):
        """This rank keeps e's optimizer state and updates it: always, but across ranks
        where the split gave e to another."""
        return self._dist is None or self._dist.stage == 3 or \
            self._owner[id(e)] == self._dist.rank

    def _wants_master(self, e):
        if e.dtype not in _SIXTEEN:
            return False
        return self.master_dtype in ("auto", torch.float32)

    def _step_bytes(self, e, amsgrad):
        """The room a step of e takes in the host tier: each tensor rounded up to the
        tier's 4 KiB pages, as the tier places it."""
        n = _numel(e.sshape)
        f32 = 3 + bool(amsgrad) + self._wants_master(e)
        return page_round(n * e.dtype.itemsize) + f32 * page_round(4 * n)

    def _state_tensors(self, e, amsgrad):
        eng, home = e.owner.engine, e.owner.home
        made = []

        def get(suffix, dtype="float32"):
            name = e.name + suffix
            try:
                return eng.lookup(name)
            except Error:
                t = eng.register(name, (e.sshape, dtype), home=home)
                made.append(t)
                return t

        try:
            if e.m is None:
                e.m = get(".exp_avg")
            if e.v is None:
                e.v = get(".exp_avg_sq")
            if amsgrad and e.vmax is None:
                e.vmax = get(".max_exp_avg_sq")
            if self._wants_master(e) and e.master is None:
                e.master = get(".master")
                if e.master in made:
                    with e.owner._lock:
                        pins = eng.fetch_all([e.handle, e.master], "host", dirty=True)
                        try:
                            with _disabled():
                                view_as(pins[1], e.sshape, torch.float32).copy_(
                                    view_as(pins[0], e.sshape, e.dtype))
                        finally:
                            pins[0].release()
                            pins[1].release(dirty=True)
        except BaseException:
            for t in made:
                for attr in ("m", "v", "vmax", "master"):
                    if getattr(e, attr) == t:
                        setattr(e, attr, None)
                eng.unregister(t)
            raise

    def zero_grad(self, set_to_none=True):
        """set_to_none (the default): the gradients are forgotten, and a parameter that gets
        none before the next step is skipped by it. False: they are zeros, so that the next
        step moves every parameter, as torch's does. Either way a gradient homed on NVMe
        becomes zeros where it lies, without a byte moved (Engine.zero), so that the next
        backward does not read it back to overwrite it. model.zero_grad() does the same."""
        for group in self.param_groups:
            for p in group["params"]:
                e = p._zinf
                with e.owner._lock:
                    e.owner._sync_grad(e)
                    if set_to_none:
                        e.owner.forget_grad(e)
                    else:
                        e.owner.grad_zero(e)
                        if e.view is None:
                            e.owner._put_proxy(e)
        if self._dist is not None:
            # Nothing left to average where every gradient is gone or zeros.
            for off in {id(p._zinf.owner): p._zinf.owner
                        for g in self.param_groups for p in g["params"]}.values():
                if not any(e.has_grad and not e.fresh for e in off._entries):
                    off._unreduced = False

    # ---- the update -----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owners = {}
        for group in self.param_groups:
            for p in group["params"]:
                owners[id(p._zinf.owner)] = p._zinf.owner
        self._settle()
        for off in owners.values():
            off.settle()        # another optimizer's deferred updates of these modules
            off.release_stale()
            with off._lock:
                for e in off._entries:
                    off._sync_grad(e)
            off.reduce_grads()
        work = [(group, p) for group in self.param_groups for p in group["params"]
                if p._zinf.has_grad]
        self._has_state |= bool(work)
        engines = {id(off.engine): off.engine for off in owners.values()}
        later = []
        if self.overlap:
            # Small parameters are updated here, where an update costs less than one left
            # to a forward hook; the rest, whose reads and writes are worth hiding, wait.
            later = [(g, p) for g, p in work if _numel(p._zinf.shape) >= self.overlap_min]
            work = [(g, p) for g, p in work if _numel(p._zinf.shape) < self.overlap_min]
        done = 0
        try:
            # Across ranks each parameter is updated by its owner and its new values
            # broadcast from there, in the same order on every rank (the broadcasts are
            # collectives); alone, every one is this process's.
            # done counts the parameters whose values this step changed here.
            mine = [p for _, p in work if self._mine(p._zinf)]
            ahead = 0
            for group, p in work:
                e = p._zinf
                if self._mine(e):
                    ahead += 1
                    if ahead < len(mine):
                        self._prefetch(mine[ahead]._zinf)
                    self._step_one(group, p)
                    done += 1
                if self._dist is not None and self._dist.stage != 3:
                    self._dist.broadcast(e.owner, e, self._owner[id(e)])
                    done += not self._mine(e)
        except BaseException:
            if done:
                # Some parameters hold this step's values and others the last one's: no
                # flush may save that. The engines close without one, so the saved state
                # stays the last whole step's (reopen them with resume=True).
                for eng in engines.values():
                    eng.close_unflushed()
            raise
        if later:
            self._defer(later, owners, engines)
            self._applied = done        # a deferred one that fails tears this step
        for eng in engines.values():
            eng.step()
        for off in owners.values():
            off.prefetch_forward()
        return loss

    @staticmethod
    def _prefetch(e):
        for t in (e.handle, e.grad, e.m, e.v, e.master, e.vmax):
            if t is not None:
                e.owner.engine.prefetch(t, "host")

    def _args(self, group, e, step):
        """A parameter's update as it stands at step(): (betas, lr, eps, weight decay, the
        gradient's scale, amsgrad, step)."""
        b1, b2 = (_f(b) for b in group["betas"])
        scale = e.gscale * (-1.0 if group["maximize"] else 1.0)
        return (b1, b2, _f(group["lr"]), float(group["eps"]), float(group["weight_decay"]),
                scale, group["amsgrad"], step)

    def _step_one(self, group, p):
        e = p._zinf
        st = self.state[p]
        amsgrad = group["amsgrad"]
        if amsgrad and e.vmax is None or e.m is None:
            self._state_tensors(e, amsgrad)
        step = st.get("step", 0) + 1
        self._apply(e, self._args(group, e, step))
        st["step"] = step

    # ---- the update deferred to each parameter's next use (overlap=True) --------------------

    def _defer(self, work, owners, engines):
        for eng in engines.values():
            self._barrier_on(eng)
        first_use = {}
        for off in owners.values():
            for i, e in enumerate(off._order):
                first_use.setdefault(id(e), i)
        queue = []
        for group, p in work:
            e = p._zinf
            amsgrad = group["amsgrad"]
            if amsgrad and e.vmax is None or e.m is None:
                self._state_tensors(e, amsgrad)
            st = self.state[p]
            step = st.get("step", 0) + 1
            e.pending = (self, self._args(group, e, step))
            st["step"] = step
            queue.append(e)
        queue.sort(key=lambda e: first_use.get(id(e), len(first_use)))
        self._queue, self._next, self._engines, self._applied = queue, 0, engines, 0
        self._room = min(eng.stats()["tier"][1]["capacity_bytes"]
                         for eng in engines.values()) // 2 if engines else 0
        self._prefetch_pending()

    def _prefetch_pending(self):
        """Hints to the engine: the state of the next deferred updates to the host tier, up
        to half of it (the update at hand takes its own room)."""
        q, i = self._queue, self._next
        while i < len(q) and q[i].pending is None:
            i += 1
        self._next = i
        room, ahead = self._room, 0
        for e in q[i:i + 4]:
            if e.pending is None:
                continue
            room -= self._step_bytes(e, e.pending[1][6])
            if room < 0 or ahead == 2:
                break
            self._prefetch(e)
            ahead += 1

    def _run_pending(self, e):
        """e's deferred update, now (the owner's lock held)."""
        args = e.pending[1]
        e.pending = None
        try:
            with torch.no_grad():
                self._prefetch_pending()
                self._apply(e, args)
                if e.zero_later:
                    e.zero_later = False
                    e.owner._zero_grad_data(e)
        except BaseException:
            self._abort(e)
            raise
        self._applied += 1

    def _abort(self, failed):
        """A deferred update failed: the rest are dropped with their step counts, and where
        some were carried out the engines close without a flush (a step is a unit)."""
        for e in [failed] + self._queue:
            if e.pending is not None or e is failed:
                e.pending = None
                e.zero_later = False
                st = self.state.get(e.param)
                if st and st.get("step"):
                    st["step"] -= 1
        self._queue = []
        if self._applied:
            for eng in self._engines.values():
                eng.close_unflushed()

    def _settle(self):
        """Every update the last step() deferred, carried out now."""
        for e in self._queue:
            if e.pending is not None and e.pending[0] is self:
                e.owner.ensure(e)
        self._queue = []

    def _barrier_on(self, eng):
        if id(eng) in self._barriers:
            return
        ref = weakref.ref(self)

        def barrier():
            opt = ref()
            if opt is not None:
                opt._settle()

        eng._add_barrier(barrier)
        self._barriers[id(eng)] = eng

    def _apply(self, e, args):
        b1, b2, lr, eps, wd, scale, amsgrad, step = args
        off = e.owner
        handles = [e.handle, e.grad, e.m, e.v]
        if e.master is not None:
            handles.append(e.master)
        if amsgrad:
            handles.append(e.vmax)
        with off._lock:
            pins = off.fetch_all(handles, "host", dirty=True)
            try:
                with _disabled():
                    f32 = lambda pin: view_as(pin, e.sshape, torch.float32)  # noqa: E731
                    pv = view_as(pins[0], e.sshape, e.dtype)
                    g, m, v = f32(pins[1]), f32(pins[2]), f32(pins[3])
                    master = f32(pins[4]) if e.master is not None else None
                    vmax = f32(pins[-1]) if amsgrad else None
                    work = master if master is not None else (
                        pv if e.dtype == torch.float32 else pv.float())
                    if amsgrad:
                        _amsgrad(work, g, m, v, vmax, step, lr, b1, b2, eps, wd, scale)
                    else:
                        adamw_step(work.numpy(), g.numpy(), m.numpy(), v.numpy(), step, lr,
                                   b1, b2, eps, wd, scale)
                    if work is not pv:
                        pv.copy_(work)
                    del pv, g, m, v, master, vmax, work
            finally:
                for pin, h in zip(pins, handles):
                    pin.release(dirty=h is not e.grad)

    # ---- torch's layout -----------------------------------------------------------------

    def _indexed(self):
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield i, group, p
                i += 1

    def _where(self):
        d = self._dist
        return "alone" if d is None else f"rank {d.rank} of {d.size}, stage {d.stage}"

    def _z3(self):
        return self._dist is not None and self._dist.stage == 3

    def state_dict(self, gather=None):
        """torch.optim.AdamW's layout: {"state": {index: {"step", "exp_avg", "exp_avg_sq"
        (, "max_exp_avg_sq")}}, "param_groups": [...]}, the moments read into memory as
        float32 CPU tensors; a 16-bit parameter's master copy under "master".

        Across ranks (offload(..., group=)) no rank holds the whole state: at stages 1 and
        2 each parameter's state lives on its owner, at stage 3 every rank holds a slice of
        every moment. So once a step (or a load) made state, a plain state_dict() raises
        OffloadedError rather than give a part for the whole (before, there is none, and
        the empty state is whole). gather=True: the full state on every rank (a
        collective: every rank calls it); gather=False: this rank's part, marked
        "zero3": {"rank", "size"} (stage 3: its slices, flat and padded) or
        "owned": {"rank", "size"} (stages 1 and 2: the parameters it owns), which
        load_state_dict() takes back on the same rank of a group of the same size only.
        zinf.torch.save_checkpoint saves every rank's part at once."""
        self._settle()
        z3 = self._z3()
        d = self._dist
        if d is not None and gather is None and self._has_state:
            raise OffloadedError(
                f"zinf.torch.AdamW: across ranks (stage {d.stage}) no rank holds the whole "
                f"optimizer state ({'each a slice of every moment' if z3 else 'each parameter its owner'}"
                f"'s); state_dict(gather=True) gathers it (on every rank at once), "
                f"state_dict(gather=False) gives this rank's part, "
                f"zinf.torch.save_checkpoint saves every rank's; with transformers' Trainer, "
                f"save_only_model=True and zinf.torch.save_checkpoint")
        full = z3 and bool(gather)
        if d is not None and not z3 and gather:
            return self._gathered_owned()
        state = {}
        for i, group, p in self._indexed():
            e = p._zinf
            st = self.state.get(p, {})
            if not st.get("step"):
                continue
            out = {"step": torch.tensor(float(st["step"]))}
            for key, t in (("exp_avg", e.m), ("exp_avg_sq", e.v),
                           ("max_exp_avg_sq", e.vmax), ("master", e.master)):
                if t is not None and (key != "max_exp_avg_sq" or group["amsgrad"]):
                    out[key] = self._read(e, t, full)
            state[i] = out
        out = {"state": state, "param_groups": self._groups_out()}
        if z3 and not full:
            out["zero3"] = {"rank": self._dist.rank, "size": self._dist.size}
        elif d is not None and not z3 and gather is False:
            out["owned"] = {"rank": d.rank, "size": d.size}
        return out

    def _groups_out(self):
        groups = []
        i = 0
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = list(range(i, i + len(group["params"])))
            i += len(group["params"])
            groups.append(g)
        return groups

    def _gathered_owned(self):
        """Stages 1 and 2: every parameter's state broadcast from its owner, in the
        parameters' order on every rank (the broadcasts are collectives)."""
        d = self._dist
        state = {}
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
        for i, group, p in self._indexed():
            e = p._zinf
            src = self._owner[id(e)]
            mine = src == d.rank
            st = self.state.get(p, {}) if mine else {}
            held = (e.m, e.v, e.vmax if group["amsgrad"] else None, e.master) if mine \
                else (None,) * 4
            # The step, and which of the tensors the owner holds.
            head = torch.tensor([float(st.get("step") or 0)] +
                                [float(t is not None) for t in held], dtype=torch.float64)
            d.dist.broadcast(head, d._root(src), group=d.group)
            if head[0].item() == 0:
                continue
            out = {"step": torch.tensor(head[0].item())}
            for k, (key, t) in enumerate(zip(keys, held)):
                if head[k + 1].item() == 0:
                    continue
                v = self._read(e, t) if mine else torch.empty(e.shape, dtype=torch.float32)
                d.dist.broadcast(v, d._root(src), group=d.group)
                out[key] = v
            state[i] = out
        return {"state": state, "param_groups": self._groups_out()}

    def _read(self, e, t, full=False):
        with e.owner._lock:
            if full:
                return e.owner.z3.full_of(e.owner, e, t)
            with e.owner.engine.fetch(t, "host") as pin:
                return view_as(pin, e.sshape, torch.float32).clone()

    def load_state_dict(self, state_dict):
        """Takes what state_dict() gives, or torch.optim.AdamW's: the moments are written
        into zinf (as float32), the step counts and hyper-parameters taken; a 16-bit
        parameter without a master copy in it gets one from its current values."""
        self._settle()
        sliced = state_dict.get("zero3")
        if sliced is not None and (not self._z3() or sliced != {
                "rank": self._dist.rank, "size": self._dist.size}):
            raise ValueError(f"zinf.torch.AdamW: the state dict holds the slices of rank "
                             f"{sliced['rank']} of {sliced['size']} (stage 3); this "
                             f"optimizer is {self._where()}: load a full one "
                             f"(state_dict(gather=True))")
        owned = state_dict.get("owned")
        d = self._dist
        if owned is not None and (d is None or self._z3() or owned != {
                "rank": d.rank, "size": d.size}):
            raise ValueError(f"zinf.torch.AdamW: the state dict holds the parameters rank "
                             f"{owned['rank']} of {owned['size']} owns (stage 1 or 2); this "
                             f"optimizer is {self._where()}: load a full one "
                             f"(state_dict(gather=True))")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(groups)} parameter groups; this "
                             f"optimizer has {len(self.param_groups)}")
        for g, mine in zip(groups, self.param_groups):
            if len(g["params"]) != len(mine["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
        index = {}
        for g, mine in zip(groups, self.param_groups):
            for i, p in zip(g["params"], mine["params"]):
                index[i] = p
        for i, st in state_dict["state"].items():
            p = index.get(int(i))
            if p is None:
                raise ValueError(f"state for parameter {i}: no such parameter")
            want = p._zinf.sshape if sliced else p._zinf.shape
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):
                if key in st and tuple(st[key].shape) != want:
                    raise ValueError(f"state {key} of {p._zinf.name}: shape "
                                     f"{tuple(st[key].shape)}, the parameter's is "
                                     f"{want}")
        for g, mine in zip(groups, self.param_groups):
            for k, v in g.items():
                if k != "params" and k not in ("capturable", "differentiable"):
                    mine[k] = v
        for i, st in state_dict["state"].items():
            p = index[int(i)]
            e = p._zinf
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            self._state_tensors(e, group["amsgrad"] or "max_exp_avg_sq" in st)
            for key, t in (("exp_avg", e.m), ("exp_avg_sq", e.v),
                           ("max_exp_avg_sq", e.vmax), ("master", e.master)):
                if key in st and t is not None:
                    with e.owner._lock:
                        v = st[key]
                        if self._z3() and not sliced:     # this rank's slice of the whole
                            v = e.owner.z3.slice_of(v.float(), e)
                        with e.owner.engine.fetch(t, "host", dirty=True) as pin:
                            view_as(pin, e.sshape, torch.float32).copy_(v)
            self.state[p]["step"] = int(_f(st.get("step", 0)))
        self._has_state |= bool(state_dict["state"]) or owned is not None or sliced is not None


def _amsgrad(param, g, m, v, vmax, step, lr, b1, b2, eps, wd, scale):
    """torch.optim.AdamW's single-tensor update with amsgrad, in place, in float32."""
    if scale != 1.0:
        g = g * scale
    param.mul_(1 - lr * wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    torch.maximum(vmax, v, out=vmax)
    bc1 = 1 - b1 ** step
    bc2 = 1 - b2 ** step
    denom = (vmax.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(m, denom, value=-lr / bc1)
