"""test_torch_dist.py - zinf.torch across ranks: data parallelism over torch.distributed.

2 and 3 CPU ranks over gloo (processes spawned here, a file:// rendezvous in a temporary
folder), each with its own engine (emulated device, NVMe home in its own folder) and the
example's GPT (its head tied to its embedding) offloaded with group=WORLD, stage=1, 2 or 3,
train a few steps with clip_grad_norm_, each rank on its part of a fixed global batch,
accumulated as micro-batches. The reference is one process: the same global batch as
micro-batches with gradient accumulation (each loss divided by their count), zinf.torch on
one engine. Each step's loss (the mean over the micro-batches), clip_grad_norm_'s norm and
the final parameters match within 1e-6 relative (the norm 1e-5), each rank reduces its
gradients once a step (stage 3: once a backward, in one bucket), and each rank's optimizer
state (the moments it registered) is about 1/N of the reference's; with stage 2 its
gradients after the reduction too, another rank's refused by name; with stage 3 its
gradients' slices, and its engine homes about 1/N of the reference's bytes. A backward onto
gradients a norm read reduced already adds to their mean. Through GradScaler, one rank's
overflow has every rank skip the step. Stage 3 again on a small model with a tied head, a
parameter of fewer elements than ranks and buckets of a few parameters: p.grad read whole
matches the reference's gradients, a write into it is refused, the optimizer's state
gathered matches and loads back, sliced loads back on its rank only, unasked is refused;
a write through gathered(modify=True) is kept. Also: a stage that is none of ZeRO's is
refused, stage=None with a group is 3; ranks whose parameters differ are refused (stages 1
and 3).

Skips, saying so, where torch is not importable or torch.distributed has no gloo.
"""

import math
import os
import shutil
import sys
import tempfile
import traceback
import unittest

import zinf

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import zinf.torch as zt
except ImportError:
    torch = None

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "..", "examples")
TEXT = os.path.join(HERE, "..", "data", "torch_text.md")
PAGE = 4096
STEPS = 5
BATCH = 12          # the global batch: 6 rows a rank of 2, 4 of 3
MICRO = 2           # micro-batches a rank accumulates a step
LAYERS, DIM, HEADS, CONTEXT = 2, 64, 4, 32

if torch is not None:
    sys.path.insert(0, EXAMPLES)
    import torch_offload as ex


def _model():
    torch.manual_seed(0)
    return ex.GPT(LAYERS, DIM, HEADS, CONTEXT)


def _engine(model, swap):
    b = int(ex.state_bytes(model) * 0.25) // PAGE * PAGE
    return zinf.Engine(nvme_path=swap, device="emulated", device_bytes=b, host_bytes=b)


def _state_bytes(opt):
    """The bytes of the optimizer state this process registered: each parameter's moments
    (and master copy)."""
    n = 0
    for g in opt.param_groups:
        for p in g["params"]:
            e = p._zinf
            n += sum(t.nbytes for t in (e.m, e.v, e.vmax, e.master) if t is not None)
    return n


def _home_bytes(engine):
    """The bytes the engine homes on NVMe after a flush: parameters, gradients and
    optimizer state."""
    engine.flush()
    return engine.stats()["tier"][zinf.NVME]["used_bytes"]


def _global_batches():
    data = ex.batches(TEXT, BATCH, CONTEXT)
    return [next(data) for _ in range(STEPS)]


def _params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _scaler(on):
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if on else None


def _step(model, opt, scaler):
    """clip_grad_norm_ and the step, through GradScaler where there is one."""
    if scaler is not None:
        scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return norm


def _backward(loss, scaler, overflow=False):
    """overflow: an inf in every gradient of this backward (GradScaler skips the step)."""
    if overflow:
        loss = loss * float("inf")
    (scaler.scale(loss) if scaler is not None else loss).backward()


OVERFLOW_STEP = 2   # with GradScaler: the last micro-batch of this step overflows


def _reference(world, swap, scaled=False):
    """One process: each global batch as world * MICRO micro-batches, accumulated."""
    model = _model()
    with _engine(model, swap) as engine:
        zt.offload(model, engine, home="nvme")
        opt = zt.AdamW(model.parameters(), lr=1e-3)
        scaler = _scaler(scaled)
        losses, norms = [], []
        for step, (x, y) in enumerate(_global_batches()):
            total = 0.0
            for i, (xs, ys) in enumerate(zip(x.chunk(world * MICRO), y.chunk(world * MICRO))):
                loss = model(xs, ys) / (world * MICRO)
                _backward(loss, scaler, scaled and step == OVERFLOW_STEP and
                          i == world * MICRO - 1)
                total += loss.item()
            losses.append(total)
            norms.append(_step(model, opt, scaler))
            opt.zero_grad()
        return losses, _params(model), _state_bytes(opt), norms, _home_bytes(engine), \
            _moments(opt.state_dict())


def _moments(sd):
    """An optimizer state dict's step counts and moments, by parameter index."""
    return {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}


def _rank(rank, world, folder, mode):
    """A spawned rank: its results, or the traceback of what failed, in a file the test
    reads."""
    out = os.path.join(folder, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "rdv"),
                                rank=rank, world_size=world)
        try:
            if mode == "tiny":
                res = _tiny_run(rank, world, folder)
            elif mode.startswith("train"):
                res = _train(rank, world, folder, int(mode[5]), "peek" in mode,
                             "scaled" in mode, "buckets" in mode)
            else:
                res = _refusals(rank, world, folder)
        finally:
            dist.destroy_process_group()
        torch.save(res, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)


SMALL_BUCKET = 64 << 10     # bytes: the GPT's gradients in several buckets


def _train(rank, world, folder, stage, peek=False, scaled=False, buckets=False):
    """peek: the norm read (clip_grad_norm_ that clips nothing) after each micro-batch of
    every other step too, so that the next one accumulates onto reduced gradients; scaled:
    through torch.amp.GradScaler; buckets: gradients reduced in buckets of SMALL_BUCKET."""
    model = _model()
    with _engine(model, os.path.join(folder, f"swap{rank}")) as engine:
        kw = {"bucket_bytes": SMALL_BUCKET} if buckets else {}
        zt.offload(model, engine, home="nvme", group=dist.group.WORLD, stage=stage, **kw)
        off = model.zinf_offload
        opt = zt.AdamW(model.parameters(), lr=1e-3)
        scaler = _scaler(scaled)
        losses, scales, norms = [], [], []
        for step, (x, y) in enumerate(_global_batches()):
            mine = x.chunk(world)[rank], y.chunk(world)[rank]
            t = torch.zeros(())
            for i, (xs, ys) in enumerate(zip(mine[0].chunk(MICRO), mine[1].chunk(MICRO))):
                loss = model(xs, ys) / MICRO
                # The overflow on the last rank alone: every rank skips the step.
                _backward(loss, scaler, scaled and step == OVERFLOW_STEP and
                          rank == world - 1 and i == MICRO - 1)
                t += loss.detach()
                if peek and not len(losses) % 2:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            dist.all_reduce(t)
            losses.append(t.item() / world)
            norms.append(_step(model, opt, scaler))
            if scaler is not None:
                scales.append(scaler.get_scale())
            # The gradients this rank keeps after the step: all (stage 1), its own
            # (stage 2) or its slices (stage 3).
            kept = sum(4 * math.prod(e.sshape) for e in off._entries
                       if e.has_grad and not off.dist.is_remote(e))
            refused = None
            for p in model.parameters():
                try:
                    with zt.gathered(p, grads=True):
                        pass
                except zt.OffloadedError as err:
                    refused = str(err)
            opt.zero_grad()
        # No rank holds the whole optimizer state: a plain state_dict() refuses, naming
        # the ways that give it; gathered, every rank has all of it.
        try:
            opt.state_dict()
            opt_refused = None
        except zt.OffloadedError as err:
            opt_refused = str(err)
        moments = _moments(opt.state_dict(gather=True))
        st = engine.stats()
        pinned = [st["tier"][t]["pinned_bytes"] for t in (zinf.DEVICE, zinf.HOST)]
        return {"losses": losses, "params": _params(model), "state_bytes": _state_bytes(opt),
                "pinned": pinned, "norms": norms, "home_bytes": _home_bytes(engine),
                "tensors": st["tensors"],
                "reductions": off.z3.reductions if off.z3 else off.dist.reductions,
                "collectives": None if off.z3 else off.dist.collectives,
                "parameters": len(off._entries), "grad_bytes": kept,
                "all_grad_bytes": sum(4 * e.nbytes // e.dtype.itemsize for e in off._entries),
                "refused": refused, "scales": scales, "opt refused": opt_refused,
                "moments": moments}


class _Tiny(torch.nn.Module if torch is not None else object):
    """A head tied to the embedding (as GPT-2's), and a parameter of one element, fewer
    than the ranks: its slices are mostly padding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(11, 5)
        self.lin = torch.nn.Linear(5, 5)
        self.head = torch.nn.Linear(5, 11, bias=False)
        self.head.weight = self.emb.weight
        self.scale = torch.nn.Parameter(torch.full((1,), 1.5))

    def forward(self, idx, y):
        x = torch.tanh(self.lin(self.emb(idx))) * self.scale
        return torch.nn.functional.cross_entropy(self.head(x).view(-1, 11), y.view(-1))


TINY_BUCKET = 100   # bytes: lin's weight alone fills a bucket
TINY_STEPS = 3


def _tiny_batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 11, (12, 6), generator=g),
             torch.randint(0, 11, (12, 6), generator=g)) for _ in range(TINY_STEPS)]


def _tiny(world, swap, rank=None):
    """The tiny model trained alone (rank None: the global batch as world * MICRO
    micro-batches) or as a rank of a stage-3 group (its part as MICRO micro-batches).
    Returns the losses, clip norms, the first step's gradients as p.grad reads them, the
    parameters and the optimizer's full state."""
    model = _Tiny()
    with zinf.Engine(nvme_path=swap, device="emulated", device_bytes=1 << 20,
                     host_bytes=1 << 20) as engine:
        if rank is None:
            zt.offload(model, engine, home="host")
        else:
            zt.offload(model, engine, home="host", group=dist.group.WORLD, stage=3,
                       bucket_bytes=TINY_BUCKET)
        off = model.zinf_offload
        opt = zt.AdamW(model.parameters(), lr=1e-2)
        got = {"losses": [], "norms": [], "grads": {}, "refused": {}}
        for step, (x, y) in enumerate(_tiny_batches()):
            parts = world * MICRO if rank is None else MICRO
            if rank is not None:
                x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            t = torch.zeros(())
            for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
                loss = model(xs, ys) / parts
                loss.backward()
                t += loss.detach()
            if rank is not None:
                dist.all_reduce(t)
                t /= world
                got["reductions"] = off.z3.reductions
            got["losses"].append(t.item())
            if step == 0:
                named = dict(model.named_parameters())
                if rank is None:
                    with zt.gathered(list(named.values()), grads=True):
                        got["grads"] = {k: p.grad.clone() for k, p in named.items()}
                else:
                    # p.grad itself: the full mean, gathered as it is read.
                    got["grads"] = {k: p.grad.clone() for k, p in named.items()}
                    got["grad sum"] = model.lin.weight.grad.sum().item()
                    try:
                        model.lin.weight.grad.add_(1.0)
                    except zt.OffloadedError as err:
                        got["refused"]["grad write"] = str(err)
            got["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                               0.5).item())
            opt.step()
            opt.zero_grad()
        got["params"] = _params(model)
        if rank is None:
            got["opt"] = opt.state_dict()
            return got
        try:
            opt.state_dict()
        except zt.OffloadedError as err:
            got["refused"]["opt state"] = str(err)
        got["opt"] = full = opt.state_dict(gather=True)
        mine = opt.state_dict(gather=False)
        got["sliced"] = (mine["zero3"], [tuple(st["exp_avg"].shape)
                                         for st in mine["state"].values()],
                         {e.name: math.prod(e.sshape) for e in off._entries})
        # A full state loads back as it was; a rank's slices onto its own rank.
        opt.load_state_dict(full)
        opt.load_state_dict(mine)
        got["reloaded"] = opt.state_dict(gather=True)
        mine["zero3"] = {"rank": (rank + 1) % world, "size": world}
        try:
            opt.load_state_dict(mine)
        except ValueError as err:
            got["refused"]["other rank"] = str(err)
        # A write through gathered(modify=True) goes back into the slices.
        with zt.gathered(model.emb.weight, modify=True), torch.no_grad():
            model.emb.weight[3].fill_(7.0)
        got["written"] = model.state_dict()["emb.weight"][3].clone()
        return got


def _tiny_run(rank, world, folder):
    return _tiny(world, os.path.join(folder, f"swap{rank}"), rank)


def _refusals(rank, world, folder):
    """What offload(group=) refuses: a stage that is none of ZeRO's, a stage without a
    group, ranks that start from other values (stage 1, and stage 3, which checks before
    it slices); stage=None with a group is stage 3."""
    got = {}
    for stage in (None, 4):
        model = _model()
        with _engine(model, os.path.join(folder, f"swap{rank}-{stage}")) as engine:
            try:
                off = zt.offload(model, engine, group=dist.group.WORLD, stage=stage)
                got[stage] = f"offloaded, stage {off.dist.stage}"
                off.remove()
            except ValueError as err:
                got[stage] = str(err)
            got[f"{stage} still plain"] = all(p.data.numel() == p.numel()
                                              for p in model.parameters())
    model = _model()
    with _engine(model, os.path.join(folder, f"swap{rank}-nogroup")) as engine:
        try:
            zt.offload(model, engine, stage=1)
            got["no group"] = "offloaded"
        except ValueError as err:
            got["no group"] = str(err)
    for stage in (1, 3):
        model = _model()
        if rank == world - 1:
            with torch.no_grad():
                model.blocks[0].c_fc.bias.add_(1.0)
        with _engine(model, os.path.join(folder, f"swap{rank}-differ{stage}")) as engine:
            try:
                zt.offload(model, engine, group=dist.group.WORLD, stage=stage)
                got[f"differ{stage}"] = "offloaded"
            except ValueError as err:
                got[f"differ{stage}"] = str(err)
            got[f"differ{stage} still plain"] = all(p.data.numel() == p.numel()
                                                    for p in model.parameters())
    return got


@unittest.skipIf(torch is None, "torch is not importable: scripts/test-torch.sh runs these "
                                "in a venv with torch from PyPI")
class TestAcrossRanks(unittest.TestCase):
    def setUp(self):
        if not dist.is_available() or not dist.is_gloo_available():
            self.skipTest("torch.distributed with gloo is not available")
        base = os.environ.get("ZINF_TEST_TMPDIR") or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="torch-dist-", dir=base)
        self.addCleanup(shutil.rmtree, self.dir, True)

    def spawn(self, world, mode):
        folder = tempfile.mkdtemp(prefix=f"{mode}{world}-", dir=self.dir)
        mp.spawn(_rank, args=(world, folder, mode), nprocs=world, join=True)
        out = []
        for r in range(world):
            res = torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False)
            if "error" in res:
                self.fail(f"rank {r} of {world}:\n{res['error']}")
            out.append(res)
        return out

    def check_training(self, world, stage=1, peek=False, scaled=False, buckets=False):
        ref_losses, ref_params, ref_bytes, ref_norms, ref_home, ref_moments = _reference(
            world, os.path.join(tempfile.mkdtemp(prefix="ref-", dir=self.dir), "swap"), scaled)
        ranks = self.spawn(world, f"train{stage}" + ("peek" if peek else "") +
                           ("scaled" if scaled else "") + ("buckets" if buckets else ""))
        for r, res in enumerate(ranks):
            for step, (a, b) in enumerate(zip(ref_losses, res["losses"])):
                self.assertLessEqual(abs(a - b) / abs(a), 1e-6,
                                     f"rank {r}, step {step}: loss {b}, {a} in one process")
            for step, (a, b) in enumerate(zip(ref_norms, res["norms"])):
                if math.isfinite(a) or math.isfinite(b):
                    self.assertLessEqual(abs(a - b) / abs(a), 1e-5, f"rank {r}, step "
                                         f"{step}: clip_grad_norm_ {b}, {a} in one process")
            # The parameters: the whole model within 1e-6 relative, each tensor within
            # 1e-5. The ranks sum the micro-batches' gradients in another order than the
            # accumulation does; a gradient that is only rounding (the attention's key bias,
            # to which the softmax is blind) then steps AdamW by lr in another direction.
            diff = total = 0.0
            for name, want in ref_params.items():
                got = res["params"][name]
                gap = ((got - want).norm() / want.norm()).item()
                self.assertLessEqual(gap, 1e-5, f"rank {r}: {name} is {gap} away")
                diff += (got - want).double().square().sum().item()
                total += want.double().square().sum().item()
            gap = (diff / total) ** 0.5
            self.assertLessEqual(gap, 1e-6, f"rank {r}: the parameters are {gap} away")
            if os.environ.get("ZINF_TEST_VERBOSE"):
                print(f"\n{world} ranks, stage {stage}, rank {r}: parameters {gap:.3g} "
                      f"away, state {res['state_bytes']} of {ref_bytes} bytes, gradients "
                      f"{res['grad_bytes']} of {res['all_grad_bytes']}, homes {res['home_bytes']} of "
                      f"{ref_home}", file=sys.stderr)
            self.assertEqual(res["pinned"], [0, 0])
            self.assertIn("state_dict(gather=True)", res["opt refused"] or "", f"rank {r}")
            self.assertEqual(res["moments"].keys(), ref_moments.keys(), f"rank {r}")
            for i, want in ref_moments.items():
                got = res["moments"][i]
                self.assertEqual(got.keys(), want.keys(), f"rank {r}, parameter {i}")
                self.assertEqual(got["step"].item(), want["step"].item())
                for k in ("exp_avg", "exp_avg_sq"):
                    gap = ((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)).item()
                    self.assertLessEqual(gap, 1e-4, f"rank {r}, parameter {i}: {k} {gap} away")
            # One reduction of each gradient a step, though clip_grad_norm_ and the step
            # both read them; a peek's step one more for each micro-batch but the last
            # (whose reduction the step's clip_grad_norm_ finds done).
            reads = STEPS + (STEPS + 1) // 2 * (MICRO - 1) if peek else STEPS
            if stage == 3:
                # Stage 3 reduces in each backward, the whole model in one bucket.
                self.assertEqual(res["reductions"], STEPS * MICRO)
                # Its engine homes 1/N of what one process's does, give or take a page
                # for each of its tensors (each takes whole pages, and a slice's padding).
                most = ref_home / world + PAGE * res["tensors"]
                self.assertLessEqual(res["home_bytes"], most, f"rank {r}")
                self.assertLess(res["home_bytes"], 0.6 * ref_home, f"rank {r}")
            else:
                self.assertEqual(res["reductions"], reads * res["parameters"])
                # In buckets: one all_reduce for the whole model (25 MiB), or a few for
                # SMALL_BUCKET, where one a gradient was.
                if buckets:
                    self.assertGreater(res["collectives"], reads)
                    self.assertLess(res["collectives"], reads * res["parameters"] // 2)
                else:
                    self.assertEqual(res["collectives"], reads)
            grads = res["grad_bytes"] / res["all_grad_bytes"]
            if stage == 1:
                self.assertEqual(grads, 1.0)
                self.assertIsNone(res["refused"])
            else:
                # Each gradient on its owner alone (stage 2; the others' refused by name)
                # or sliced (stage 3, where gathered() reads them whole).
                self.assertLessEqual(grads, 1.5 / world, f"rank {r} keeps {grads}")
                if stage == 2:
                    self.assertIn("stage=2", res["refused"])
                else:
                    self.assertIsNone(res["refused"])
            share = res["state_bytes"] / ref_bytes
            self.assertGreater(res["state_bytes"], 0)
            self.assertLessEqual(share, 1.5 / world, f"rank {r} holds {share} of the state")
        # Every parameter's state on exactly one rank (stage 3: a slice of each on every
        # rank, padded to equal slices).
        if stage == 3:
            pad = sum(res["state_bytes"] for res in ranks) - ref_bytes
            self.assertTrue(0 <= pad <= 8 * world * res["parameters"], pad)
        else:
            self.assertEqual(sum(res["state_bytes"] for res in ranks), ref_bytes)
        self.assertLess(ref_losses[-1], ref_losses[0])
        if scaled:
            for r, res in enumerate(ranks):
                want = [2.0 ** 10] * OVERFLOW_STEP + [2.0 ** 9] * (STEPS - OVERFLOW_STEP)
                self.assertEqual(res["scales"], want, f"rank {r}")

    def test_two_ranks_match_one_process_with_accumulation(self):
        self.check_training(2)

    def test_three_ranks_match_one_process_with_accumulation(self):
        self.check_training(3)

    def test_stage2_two_ranks_match_one_process(self):
        self.check_training(2, stage=2)

    def test_stage2_three_ranks_match_one_process(self):
        self.check_training(3, stage=2)

    def test_stages_1_2_bucketed(self):
        """Stages 1 and 2 reduce their gradients in buckets of bucket_bytes: a few
        collectives a step where one a parameter was, the same means."""
        self.check_training(2, stage=1, buckets=True)
        self.check_training(3, stage=2, buckets=True)

    def test_stage3_two_ranks_match_one_process(self):
        self.check_training(2, stage=3)

    def test_stage3_three_ranks_match_one_process(self):
        self.check_training(3, stage=3)

    def test_stage3_tied_tiny_and_bucketed(self):
        """Stage 3 on a model with a head tied to its embedding and a parameter of one
        element (fewer than the ranks), home in host memory, gradients in buckets of a few
        parameters: as one process, p.grad read whole, the optimizer's state gathered or
        sliced on request and refused without one."""
        for world in (2, 3):
            ref = _tiny(world, os.path.join(tempfile.mkdtemp(dir=self.dir), "swap"))
            for r, got in enumerate(self.spawn(world, "tiny")):
                where = f"rank {r} of {world}"
                for a, b in zip(ref["losses"] + ref["norms"], got["losses"] + got["norms"]):
                    self.assertLessEqual(abs(a - b) / abs(a), 1e-6, where)
                for name, want in ref["grads"].items():
                    gap = ((got["grads"][name] - want).norm() / want.norm()).item()
                    self.assertLessEqual(gap, 1e-6, f"{where}: p.grad of {name}")
                self.assertAlmostEqual(got["grad sum"], ref["grads"]["lin.weight"].sum().item(),
                                       places=6)
                self.assertIn("lin.weight", got["refused"]["grad write"])
                for name, want in ref["params"].items():
                    gap = ((got["params"][name] - want).norm() / want.norm()).item()
                    self.assertLessEqual(gap, 1e-6, f"{where}: {name}")
                self.assertEqual(set(got["params"]), {"emb.weight", "lin.weight", "lin.bias",
                                                      "head.weight", "scale"})
                for i, st in ref["opt"]["state"].items():
                    for key in ("exp_avg", "exp_avg_sq"):
                        for full in (got["opt"], got["reloaded"]):
                            self.assertEqual(full["state"][i][key].shape, st[key].shape)
                            gap = ((full["state"][i][key] - st[key]).norm() /
                                   st[key].norm()).item()
                            self.assertLessEqual(gap, 1e-5, f"{where}: {key} of {i}")
                marker, shapes, slices = got["sliced"]
                self.assertEqual(marker, {"rank": r, "size": world})
                self.assertEqual(shapes, [(n,) for n in slices.values()])
                self.assertEqual(slices["scale"], 1)    # one element on each rank
                self.assertIn("gather=True", got["refused"]["opt state"])
                self.assertIn(f"slices of rank {(r + 1) % world}", got["refused"]["other rank"])
                self.assertTrue(torch.equal(got["written"], torch.full((5,), 7.0)), where)
                # Each backward's gradients in 2 or 3 buckets: fewer collectives than
                # the 4 parameters.
                backwards = TINY_STEPS * MICRO
                self.assertTrue(2 * backwards <= got["reductions"] <= 3 * backwards,
                                f"{where}: {got['reductions']} reductions")

    def test_backward_onto_reduced_gradients(self):
        """A norm read between micro-batches reduces them; the next backward adds to the
        mean (stage 1: on every rank; stage 2: on the owner, scaled back to a sum)."""
        self.check_training(2, stage=1, peek=True)
        self.check_training(3, stage=2, peek=True)
        self.check_training(2, stage=3, peek=True)

    def test_grad_scaler(self):
        """GradScaler's unscale_ reads the gradients first: reduced there, its overflow
        check on the mean (stage 2: the owner's, exchanged). One rank's overflow has every
        rank skip the step and halve the scale."""
        self.check_training(2, stage=1, scaled=True)
        self.check_training(2, stage=2, scaled=True)
        self.check_training(3, stage=3, scaled=True)

    def test_refusals(self):
        for r, got in enumerate(self.spawn(2, "refuse")):
            self.assertEqual(got[None], "offloaded, stage 3", f"rank {r}")
            self.assertIn("stage=4", got[4], f"rank {r}")
            self.assertIn("stage=3", got[4])
            for stage in (None, 4):
                self.assertTrue(got[f"{stage} still plain"])
            self.assertIn("give group=", got["no group"])
            for stage in (1, 3):
                self.assertIn("differs across the ranks", got[f"differ{stage}"])
                self.assertIn("blocks.0.c_fc.bias", got[f"differ{stage}"])
                self.assertTrue(got[f"differ{stage} still plain"])


if __name__ == "__main__":
    unittest.main()
