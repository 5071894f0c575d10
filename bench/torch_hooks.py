#!/usr/bin/env python3
"""torch_hooks.py - what zinf.torch's hooks cost per parameter tensor, with nothing to move.

    PYTHONPATH=build/python python3 bench/torch_hooks.py [--layers 12,48]
        [--modes host,nvme,host:host,hooks] [--batch 8] [--steps 20] [--rounds 5]
        [--threads 1] [--profile N] [--json FILE]

Models of L x nn.Linear(64, 64) in sequence (2 L parameter tensors, 16 KiB each), resident:
plain PyTorch (torch.optim.AdamW) against the same model offloaded through zinf.torch (an
emulated device, both tiers large enough that every copy stays resident after the first
step) with zinf.torch.AdamW. A mode HOME[:TIER] homes the parameters on HOME ("host" or
"nvme") and has the forward and backward use them in TIER ("device", the default, or
"host"): on the emulated device the forward after a step waits for the copy thread to
bring each updated parameter up from the host tier, and with TIER "host" nothing is
copied, so that the hooks' own cost is left. Every model is built
once; rounds interleave them (each round runs --steps steps of each, after one warm-up
step), and each phase's time is the median over all the rounds' steps:
forward (model(x) and the loss), backward (loss.backward()), step (opt.step()) and zero
(opt.zero_grad()). The per-tensor cost is (offloaded - plain) / tensors, in microseconds,
per phase; "slope" is the same from the difference between the largest and the smallest
model, which leaves out what a step costs once whatever its size. Mode "hooks" is the plain
model with no-op hooks of each kind zinf.torch installs (forward pre and post, each
parameter's gradient pre-hook and post-accumulate-grad hook, saved_tensors_hooks; each under
torch.compiler.disable as zinf.torch's are): what torch itself takes to call them, a floor
for the hooks' cost. "hooks-bwd" has a no-op full backward pre-hook alone, and
"hooks-gradfn" a no-op prehook on each module's output's grad_fn, set by a forward hook
(kinds zinf.torch's backward used before it fetched on unpacking).

--profile N: then N more steps of the largest model's first offloaded mode with its forward
and backward under cProfile (the steps between them not), and the 15 functions with the
most time of their own.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

import zinf
import zinf.torch

PHASES = ("forward", "backward", "step", "zero")
NOOP = {"hooks": "no-op hooks", "hooks-bwd": "full bwd pre only",
        "hooks-gradfn": "grad_fn prehook only"}


def make_model(layers, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(layers)))


class Run:
    """One model and its optimizer, plain or offloaded, and its phases' times."""

    def __init__(self, layers, mode, batch, swap):
        home, _, tier = (mode or "").partition(":")
        self.layers, self.mode = layers, mode
        self.model = make_model(layers)
        self.tensors = sum(1 for _ in self.model.parameters())
        self.engine = None
        hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        if mode is None or mode in NOOP:
            self.opt = torch.optim.AdamW(self.model.parameters(), **hp)
            if mode in NOOP:
                self._noop_hooks(mode)
        else:
            state = 16 * sum(p.numel() for p in self.model.parameters())
            room = max(4 * state, 16 << 20)
            path = os.path.join(swap, f"{home}-{tier}-{layers}")
            self.engine = zinf.Engine(nvme_path=path, device_bytes=room, host_bytes=room,
                                      device="emulated", overwrite=True)
            zinf.torch.offload(self.model, self.engine, home=home, tier=tier or "device")
            self.opt = zinf.torch.AdamW(self.model.parameters(), **hp)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(batch, 64, generator=g)
        self.y = torch.randn(batch, 64, generator=g)
        self.times = {p: [] for p in PHASES}
        self.losses = []

    def _noop_hooks(self, mode):
        """The hooks zinf.torch installs, doing nothing: torch's own cost of calling them."""
        noop = torch.compiler.disable(lambda *a: None)

        def prehook_on_output(m, args, out):
            if out.grad_fn is not None:
                out.grad_fn.register_prehook(noop)

        for m in self.model:
            if mode == "hooks":
                m.register_forward_pre_hook(noop)
                m.register_forward_hook(noop, always_call=True)
            if mode == "hooks-bwd":
                m.register_full_backward_pre_hook(noop)
            if mode == "hooks-gradfn":
                m.register_forward_hook(prehook_on_output)
        if mode != "hooks":
            return
        for p in self.model.parameters():
            p.register_hook(noop)
            p.register_post_accumulate_grad_hook(noop)
        forward = self.model.forward

        @torch.compiler.disable
        def forward_with_saved_hooks(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                return forward(*args, **kwargs)

        self.model.forward = forward_with_saved_hooks

    @property
    def label(self):
        if self.mode is None or self.mode in NOOP:
            return {None: "plain", **NOOP}[self.mode]
        home, _, tier = self.mode.partition(":")
        return f"zinf {home}>{tier or 'device'}"

    def step(self, record=True):
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self.opt.zero_grad()
        t4 = time.perf_counter()
        if record:
            for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                self.times[p].append(dt * 1e6)
            self.losses.append(loss.item())

    def profiled_step(self, prof):
        """One step with prof enabled around its forward and backward only."""
        prof.enable()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        prof.disable()
        self.opt.step()
        self.opt.zero_grad()

    def median(self, phase):
        if phase == "total":
            return sum(self.median(p) for p in PHASES)
        return statistics.median(self.times[phase])

    def close(self):
        if self.engine is not None:
            self.engine.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="12,48")
    ap.add_argument("--modes", default="host,nvme,host:host,hooks",
                    help="HOME[:TIER] for each offloaded run; \"hooks\" adds the model with "
                         "no-op hooks of the kinds zinf.torch installs")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--swap", help="directory for the engines' NVMe homes (a temporary one)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    layers = [int(x) for x in a.layers.split(",")]
    modes = [m for m in a.modes.split(",") if m]

    with tempfile.TemporaryDirectory(prefix="zinf-hooks-", dir=a.swap) as swap:
        runs = [Run(n, m, a.batch, swap) for n in layers for m in [None] + modes]
        for r in runs:
            r.step(record=False)
        for _ in range(a.rounds):
            for r in runs:
                for _ in range(a.steps):
                    r.step()

        for r in runs:   # the same arithmetic: the offloaded losses track the plain ones
            ref = next(q for q in runs if q.layers == r.layers and q.mode is None)
            gap = max(abs(x - y) / abs(y) for x, y in zip(r.losses, ref.losses))
            if gap > 1e-4:
                print(f"torch_hooks.py: {r.label} at {r.layers} layers: losses off plain "
                      f"by {gap:.1e}", file=sys.stderr)
                sys.exit(1)

        cols = PHASES + ("total",)
        print(f"torch {torch.__version__}, {a.threads} thread(s), batch {a.batch}, "
              f"{a.rounds} rounds x {a.steps} steps; median us per phase")
        print(f"{'model':>26s} " + " ".join(f"{c:>9s}" for c in cols) + "   ms/step")
        out = {"torch": torch.__version__, "threads": a.threads, "batch": a.batch,
               "rounds": a.rounds, "steps": a.steps, "runs": []}
        for r in runs:
            med = {c: r.median(c) for c in cols}
            print(f"{r.label + ' x' + str(r.layers):>26s} "
                  + " ".join(f"{med[c]:9.1f}" for c in cols) + f"   {med['total'] / 1e3:7.3f}")
            out["runs"].append(dict(layers=r.layers, tensors=r.tensors, mode=r.label,
                                    median_us=med))
        print("\nper parameter tensor, (offloaded - plain) / tensors, us:")
        print(f"{'':>26s} " + " ".join(f"{c:>9s}" for c in cols))
        per = {}
        for r in runs:
            if r.mode is None:
                continue
            ref = next(q for q in runs if q.layers == r.layers and q.mode is None)
            d = {c: (r.median(c) - ref.median(c)) / r.tensors for c in cols}
            per[(r.mode, r.layers)] = d
            print(f"{r.label + ' x' + str(r.layers):>26s} "
                  + " ".join(f"{d[c]:9.1f}" for c in cols))
        if len(layers) > 1:
            lo, hi = min(layers), max(layers)
            for h in modes:
                rs = {(q.mode, q.layers): q for q in runs}
                dt = 2 * (hi - lo)
                d = {c: ((rs[h, hi].median(c) - rs[None, hi].median(c))
                         - (rs[h, lo].median(c) - rs[None, lo].median(c))) / dt for c in cols}
                per[(h, "slope")] = d
                label = next(q.label for q in runs if q.mode == h)
                print(f"{label + ' slope':>26s} " + " ".join(f"{d[c]:9.1f}" for c in cols))
        out["per_tensor_us"] = [dict(mode=h, layers=n, **d) for (h, n), d in per.items()]

        zmodes = [m for m in modes if m not in NOOP]
        if a.profile and zmodes:
            r = next(q for q in runs if q.layers == max(layers) and q.mode == zmodes[0])
            prof = cProfile.Profile()
            for _ in range(a.profile):
                r.profiled_step(prof)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
            print(f"\ncProfile, the forward and backward of {a.profile} steps of {r.label} "
                  f"x{r.layers} ({r.tensors} tensors), by tottime:")
            print(s.getvalue())

        for r in runs:
            r.close()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
