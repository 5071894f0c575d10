"""test_torch_ckpt.py - zinf.torch checkpoints across ranks: save_checkpoint/load_checkpoint
re-cut onto another number of ranks and another stage, and save/load of Hugging Face files
with the parameters sliced.

The harness is test_torch_dist.py's (gloo ranks spawned, the example's GPT with its head
tied to its embedding, each rank its part of a fixed global batch as micro-batches). A run
that never stops: 2 ranks at stage 3 train SPLIT steps, save a checkpoint (and a Hugging
Face copy with zinf.torch.save, in shards), and train on to STEPS. Each resumed run starts
from a model initialised otherwise, loads the checkpoint and trains the same last steps:
3 ranks at stage 3, one process alone, 2 ranks at stage 1 (which saves the checkpoint
again, as stage 1 writes it) and 3 ranks at stage 2 from that one. Each must give the
uninterrupted run's losses (1e-6 relative) and final parameters (1e-6 for the model, 1e-5 a
tensor, as test_torch_dist.py's), the optimizer's moments and step counts bit for bit as
they were saved, and its hyper-parameters. zinf.torch.save across 2 ranks writes with rank 0
alone, the same tensors one process writes; zinf.torch.load on 3 ranks at stage 3 reads
them back. Errors: a missing shard, a truncated shard, no manifest, a model of other names
or shapes, each naming the file and the tensor and leaving the model as it was (on 2 ranks
too: every rank raises); a save that fails leaves the previous checkpoint loadable, and a
save that completes removes the previous one's files.

Skips, saying so, where torch is not importable or torch.distributed has no gloo.
"""

import json
import os
import shutil
import tempfile
import traceback
import unittest

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import zinf.torch as zt
    import test_torch_dist as h
except ImportError:
    torch = None

SPLIT = 2           # the step after which the checkpoint is taken
SHARD = "200KB"     # zinf.torch.save's max_shard_size: the GPT in a few files


def _json(path, value=None):
    """The JSON at path, or value written there."""
    with open(path, "r" if value is None else "w") as f:
        return json.load(f) if value is None else json.dump(value, f)


def _other_model():
    """The GPT initialised otherwise: a load that left a tensor alone would show."""
    torch.manual_seed(7)
    return h.ex.GPT(h.LAYERS, h.DIM, h.HEADS, h.CONTEXT)


def _steps(model, opt, rank, world, batches):
    """Train on batches: each rank its part as MICRO micro-batches (alone: the whole), with
    clip_grad_norm_. Returns the losses, each the mean over the global batch."""
    losses = []
    for x, y in batches:
        mine = (x.chunk(world)[rank], y.chunk(world)[rank]) if world > 1 else (x, y)
        t = torch.zeros(())
        for xs, ys in zip(mine[0].chunk(h.MICRO), mine[1].chunk(h.MICRO)):
            loss = model(xs, ys) / h.MICRO
            loss.backward()
            t += loss.detach()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return losses


def _opt_state(opt, stage):
    """The optimizer's state as it is: gathered whole at stage 3, this rank's parameters'
    at stages 1 and 2, all of it alone."""
    sd = opt.state_dict(gather=True) if stage == 3 else \
        opt.state_dict(gather=False if opt._dist is not None else None)
    return {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}, \
        [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]


class _Counting:
    """safetensors.torch.save_file counted: the files this process writes."""

    def __init__(self):
        import safetensors.torch as st
        self.st, self.real, self.calls = st, st.save_file, 0

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)
        self.st.save_file = counted
        return self

    def __exit__(self, *exc):
        self.st.save_file = self.real


def _run(rank, world, folder, mode, stage):
    """One run (mode "straight": the uninterrupted one; "resume": from the checkpoint; with
    "errors" the failures too) of world ranks (1: one process, no group) at stage."""
    group = dist.group.WORLD if world > 1 else None
    model = h._model() if mode == "straight" else _other_model()
    batches = h._global_batches()
    got = {}
    with h._engine(model, os.path.join(folder, f"swap{rank}")) as engine:
        kw = {"group": group, "stage": stage} if group is not None else {}
        zt.offload(model, engine, home="nvme", **kw)
        # A resumed run takes the checkpoint's learning rate, not the one it starts with.
        opt = zt.AdamW(model.parameters(), lr=1e-3 if mode == "straight" else 5e-3,
                       weight_decay=0.05)
        ckpt = os.path.join(os.path.dirname(folder), "ckpt")
        hf = os.path.join(os.path.dirname(folder), "hf")
        if mode == "straight":
            _steps(model, opt, rank, world, batches[:SPLIT])
            zt.save_checkpoint(ckpt, model, opt, step=SPLIT, extra={"note": "two steps"})
            with _Counting() as c:
                zt.save(model, hf, max_shard_size=SHARD)
            got["hf files written"] = c.calls
            got["saved"] = h._params(model)
            got["opt"] = _opt_state(opt, stage)
        else:
            if mode == "resume-hf":
                # The Hugging Face files first, each rank reading its slices.
                zt.load(model, hf)
                got["hf loaded"] = h._params(model)
            if "errors" in mode:
                got["errors"] = _errors(model, opt, ckpt, folder, rank)
            src = ckpt + "-stage1" if mode == "resume-from-stage1" else ckpt
            got["info"] = zt.load_checkpoint(src, model, opt)
            got["loaded"] = h._params(model)
            got["opt"] = _opt_state(opt, stage)
            if mode == "resume-errors" and world == 1:
                with _Counting() as c:
                    zt.save(model, hf + "-alone", max_shard_size=SHARD)
                got["hf files written"] = c.calls
                got["atomic"] = _atomic(model, opt, folder)
            if mode == "resume" and stage == 1:
                # Saved again as stage 1 writes it: rank 0 the parameters, each rank the
                # state it owns.
                zt.save_checkpoint(ckpt + "-stage1", model, opt, step=SPLIT)
                got["files"] = sorted(os.listdir(ckpt + "-stage1"))
        got["losses"] = _steps(model, opt, rank, world, batches[SPLIT:])
        got["params"] = h._params(model)
    return got


def _catch(fn):
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def _errors(model, opt, ckpt, folder, rank):
    """Each failure on a copy of the checkpoint: its message, and whether the model and the
    optimizer were left as they were."""
    before = h._params(model)
    out = {}
    base = os.path.join(os.path.dirname(folder), "broken")

    def copy(name):
        path = f"{base}-{name}"
        if rank == 0 and not os.path.exists(path):
            shutil.copytree(ckpt, path)
        if dist.is_initialized():
            dist.barrier()
        return path, _json(os.path.join(path, "manifest.json"))

    path, m = copy("missing")
    if rank == 0 and os.path.exists(os.path.join(path, m["files"][1])):
        os.remove(os.path.join(path, m["files"][1]))
    if dist.is_initialized():
        dist.barrier()
    out["missing"] = (_catch(lambda: zt.load_checkpoint(path, model, opt)), m["files"][1])
    path, m = copy("truncated")
    if rank == 0:
        f = os.path.join(path, m["files"][0])
        if os.path.getsize(f) == m["file_bytes"][0]:
            os.truncate(f, m["file_bytes"][0] - 1000)
    if dist.is_initialized():
        dist.barrier()
    out["truncated"] = (_catch(lambda: zt.load_checkpoint(path, model, opt)), m["files"][0])
    out["no manifest"] = _catch(lambda: zt.load_checkpoint(folder, model, opt))
    path, m = copy("shape")
    if rank == 0 and "[7, 7]" not in json.dumps(m):
        key = next(k for k in m["tensors"] if k.endswith("c_fc.weight"))
        m["tensors"][key]["shape"] = [7, 7]
        _json(os.path.join(path, "manifest.json"), m)
    if dist.is_initialized():
        dist.barrier()
    out["shape"] = _catch(lambda: zt.load_checkpoint(path, model, opt))
    # A model of other names: one layer fewer.
    torch.manual_seed(0)
    small = h.ex.GPT(1, h.DIM, h.HEADS, h.CONTEXT)
    out["names"] = _catch(lambda: zt.load_checkpoint(ckpt, small))
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in h._params(model).items())
    return out


def _atomic(model, opt, folder):
    """One process: a save that fails half-way leaves the folder's checkpoint loadable as
    it was; one that completes replaces it and removes its files."""
    import zinf.torch._ckpt as ck
    path = os.path.join(folder, "atomic")
    zt.save_checkpoint(path, model, opt, step=1)
    first = sorted(os.listdir(path))
    real = ck._write_shard

    def failing(p, pieces):
        with open(p + ".tmp", "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device (injected)")

    ck._write_shard = failing
    try:
        err = _catch(lambda: zt.save_checkpoint(path, model, opt, step=2))
    finally:
        ck._write_shard = real
    after_failure = sorted(os.listdir(path))
    info = zt.load_checkpoint(path, model, opt)
    zt.save_checkpoint(path, model, opt, step=3)
    return {"error": err, "first": first, "after failure": after_failure,
            "loaded step": info["step"], "last": sorted(os.listdir(path))}


def _rank(rank, world, folder, mode, stage):
    out = os.path.join(folder, f"rank{rank}.pt")
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method="file://" +
                                    os.path.join(folder, "rdv"), rank=rank,
                                    world_size=world)
        try:
            res = _run(rank, world, folder, mode, stage)
        finally:
            if world > 1:
                dist.destroy_process_group()
        torch.save(res, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)


@unittest.skipIf(torch is None, "torch is not importable: scripts/test-torch.sh runs these "
                                "in a venv with torch from PyPI")
class TestCheckpoints(unittest.TestCase):
    def setUp(self):
        if not dist.is_available() or not dist.is_gloo_available():
            self.skipTest("torch.distributed with gloo is not available")
        base = os.environ.get("ZINF_TEST_TMPDIR") or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="torch-ckpt-", dir=base)
        self.addCleanup(shutil.rmtree, self.dir, True)

    def spawn(self, world, mode, stage):
        folder = tempfile.mkdtemp(prefix=f"{mode}{world}-", dir=self.dir)
        if world == 1:
            _rank(0, 1, folder, mode, stage)
        else:
            mp.spawn(_rank, args=(world, folder, mode, stage), nprocs=world, join=True)
        out = []
        for r in range(world):
            res = torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False)
            if "error" in res:
                self.fail(f"{mode}, rank {r} of {world}:\n{res['error']}")
            out.append(res)
        return out

    def same_params(self, got, want, where, tol=1e-6):
        diff = total = 0.0
        for name, w in want.items():
            g = got[name]
            gap = ((g - w).norm() / w.norm()).item()
            self.assertLessEqual(gap, 1e-5, f"{where}: {name} is {gap} away")
            diff += (g - w).double().square().sum().item()
            total += w.double().square().sum().item()
        self.assertLessEqual((diff / total) ** 0.5, tol, where)

    def same_state(self, got, saved, where):
        """Each moment and step count this rank holds is the saved one, bit for bit; the
        hyper-parameters are the saved ones."""
        (state, groups), (want, want_groups) = got, saved
        self.assertEqual(groups, want_groups, where)
        self.assertTrue(state, f"{where}: no optimizer state")
        for i, st in state.items():
            for k, v in st.items():
                self.assertTrue(torch.equal(v, want[i][k]), f"{where}: {k} of {i}")

    def test_checkpoint_recut(self):
        straight = self.spawn(2, "straight", 3)
        ref = straight[0]
        index = _json(os.path.join(self.dir, "hf", "model.safetensors.index.json"))
        shards = len(set(index["weight_map"].values()))
        self.assertGreater(shards, 1)
        for r, res in enumerate(straight):
            # Rank 0 alone writes the files.
            self.assertEqual(res["hf files written"], shards if r == 0 else 0, f"rank {r}")
        saved, saved_opt = ref["saved"], ref["opt"]
        runs = [("resume-hf", 3, 3), ("resume-errors", 1, None), ("resume", 2, 1),
                ("resume-from-stage1", 3, 2)]
        for mode, world, stage in runs:
            ranks = self.spawn(world, mode, stage)
            for r, res in enumerate(ranks):
                where = f"{mode} on {world} ranks at stage {stage}, rank {r}"
                for name, want in saved.items():
                    self.assertTrue(torch.equal(res["loaded"][name], want),
                                    f"{where}: {name} loaded")
                self.same_state(res["opt"], saved_opt, where)
                stage1 = mode == "resume-from-stage1"
                self.assertEqual(res["info"], {
                    "step": SPLIT, "world_size": 2, "stage": 1 if stage1 else 3,
                    "extra": None if stage1 else {"note": "two steps"}}, where)
                for step, (a, b) in enumerate(zip(ref["losses"], res["losses"])):
                    self.assertLessEqual(abs(a - b) / abs(a), 1e-6,
                                         f"{where}: step {SPLIT + step}: loss {b}, {a}")
                self.same_params(res["params"], ref["params"], where)
                if "hf loaded" in res:
                    for name, want in saved.items():
                        self.assertTrue(torch.equal(res["hf loaded"][name], want),
                                        f"{where}: {name} from the Hugging Face files")
            if mode == "resume":
                files = ranks[0]["files"]
                self.assertIn("manifest.json", files)
                self.assertEqual(len([f for f in files if f.endswith(".safetensors")]), 2)
            if mode == "resume-errors":
                self.check_errors(ranks[0])
                self.assertEqual(ranks[0]["hf files written"], shards)
                self.same_hf_files()

    def same_hf_files(self):
        """zinf.torch.save on 2 ranks at stage 3 wrote what one process writes."""
        from safetensors import safe_open
        hf, alone = os.path.join(self.dir, "hf"), os.path.join(self.dir, "hf-alone")
        index = _json(os.path.join(hf, "model.safetensors.index.json"))
        self.assertEqual(index, _json(os.path.join(alone, "model.safetensors.index.json")))
        for f in sorted(set(index["weight_map"].values())):
            with safe_open(os.path.join(hf, f), "pt") as a, \
                    safe_open(os.path.join(alone, f), "pt") as b:
                self.assertEqual(sorted(a.keys()), sorted(b.keys()))
                for k in a.keys():
                    self.assertTrue(torch.equal(a.get_tensor(k), b.get_tensor(k)), k)

    def check_errors(self, res):
        e = res["errors"]
        msg, fname = e["missing"]
        self.assertIn("FileNotFoundError", msg)
        self.assertIn(fname, msg)
        self.assertRegex(msg, r"places \S+ \(and rank 1")
        msg, fname = e["truncated"]
        self.assertIn(fname, msg)
        self.assertIn("truncated", msg)
        self.assertRegex(msg, r"tensor \S+ lies past its end")
        self.assertIn("manifest.json: no checkpoint manifest", e["no manifest"])
        self.assertIn("c_fc.weight has shape (7, 7)", e["shape"])
        self.assertIn("blocks.1.", e["names"])
        self.assertTrue(e["unchanged"])
        a = res["atomic"]
        self.assertIn("injected", a["error"])
        self.assertEqual(a["loaded step"], 1)
        shards = lambda fs: [f for f in fs if f.endswith(".safetensors")]  # noqa: E731
        self.assertEqual(shards(a["after failure"]), shards(a["first"]))
        self.assertEqual(len(shards(a["last"])), 1)
        self.assertNotEqual(shards(a["last"]), shards(a["first"]))
        self.assertFalse([f for f in a["last"] if f.endswith(".tmp")])

    def test_errors_on_every_rank(self):
        """A shard missing on 2 ranks: every rank raises (the one that finds it missing
        names the file), and neither changes its model."""
        self.spawn(2, "straight", 3)
        for r, res in enumerate(self.spawn(2, "resume-errors", 1)):
            e = res["errors"]
            self.assertIsNotNone(e["missing"][0], f"rank {r}")
            self.assertTrue(e["missing"][0].startswith(("FileNotFoundError",
                                                        "RuntimeError")), e["missing"][0])
            self.assertIn("manifest.json: no checkpoint manifest", e["no manifest"])
            self.assertTrue(e["unchanged"], f"rank {r}")


if __name__ == "__main__":
    unittest.main()
