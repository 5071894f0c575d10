#!/usr/bin/env python3
"""ds_schedules.py - zinf train's learning-rate schedules against DeepSpeed's own scheduler
classes (deepspeed.runtime.lr_schedules), step for step, for scripts/check-deepspeed.sh.

For each case a config is written, `zinf train --dry-run --print-lr N` prints zinf's rate
(and Adam's betas, which OneCycle cycles) of steps 1..N, and DeepSpeed's scheduler is built over a torch optimizer with the same
parameters and stepped as DeepSpeed's engine steps it (once after each optimizer step; the
rate of step 1 is what its constructor set). The rates must be equal as doubles.

    ds_schedules.py ZINF_BINARY [STEPS]     (default 1000)
"""
import json
import os
import subprocess
import sys
import tempfile

import logging

import torch
from deepspeed.runtime import lr_schedules as ds
from deepspeed.utils import logger

logger.setLevel(logging.ERROR)  # its "before it has started" warning at each constructor

LR = 0.003
CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 0.002, "warmup_num_steps": 300}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 77,
                  "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_min_lr": 1e-6, "warmup_max_lr": 0.002, "warmup_num_steps": 100,
                       "total_num_steps": 900}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.01, "cos_min_ratio": 0.001,
                        "warmup_num_steps": 50, "total_num_steps": 700}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 37,
                     "lr_range_test_step_rate": 0.5}),
    ("LRRangeTest", {"lr_range_test_min_lr": 2e-4, "lr_range_test_step_size": 100,
                     "lr_range_test_step_rate": 3.0, "lr_range_test_staircase": True}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 3e-3, "cycle_first_step_size": 300,
                  "cycle_second_step_size": 200, "decay_step_size": 50, "decay_lr_rate": 0.2,
                  "decay_mom_rate": 0.01}),
    ("OneCycle", {"cycle_min_lr": 2e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 170,
                  "cycle_first_stair_count": 7, "cycle_second_stair_count": 3,
                  "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}),
    ("OneCycle", {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_first_step_size": 400,
                  "cycle_momentum": False}),
]


def zinf_rates(zinf, kind, params, steps, folder):
    cfg = os.path.join(folder, "cfg.json")
    with open(cfg, "w") as f:
        json.dump({"optimizer": {"type": "AdamW", "params": {"lr": LR}},
                   "scheduler": {"type": kind, "params": params}}, f)
    out = subprocess.run([zinf, "train", "--dry-run", "--config", cfg, "--data", cfg,
                          "--steps", str(steps), "--print-lr", str(steps)],
                         check=True, capture_output=True, text=True).stdout
    rows = [l.split() for l in out.splitlines() if l.startswith("lr ")]
    # OneCycle with cycle_momentum adds the betas; otherwise they are the optimizer's
    return [float(r[2]) for r in rows], [(float(r[4]), float(r[5])) if len(r) > 5 else
                                         (0.9, 0.999) for r in rows]


def deepspeed_rates(kind, params, steps):
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = getattr(ds, kind)(opt, **params)
    rates, betas = [], []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        betas.append(tuple(opt.param_groups[0]["betas"]))
        sched.step()
    return rates, betas


def main():
    zinf = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    bad = 0
    with tempfile.TemporaryDirectory() as folder:
        for kind, params in CASES:
            z, zb = zinf_rates(zinf, kind, params, steps, folder)
            d, db = deepspeed_rates(kind, params, steps)
            diff = [i for i in range(steps) if z[i] != d[i]]
            if kind == "OneCycle":
                # and the betas it cycles, equal as doubles (without cycle_momentum, the
                # optimizer's own, which these configs leave at their defaults)
                bdiff = [i for i in range(steps) if zb[i] != db[i]]
                if bdiff:
                    i = bdiff[0]
                    print(f"{kind}: betas differ at {len(bdiff)} steps, first {i + 1}: zinf "
                          f"{zb[i]!r}, DeepSpeed {db[i]!r}")
                    bad += 1
            worst = max(abs(a - b) / abs(b) if b else abs(a) for a, b in zip(z, d))
            print(f"{kind:15s} {json.dumps(params)}: {steps} steps, "
                  f"{'all equal' if not diff else f'{len(diff)} differ (first at step {diff[0] + 1}: zinf {z[diff[0]]!r}, DeepSpeed {d[diff[0]]!r})'}"
                  f", worst relative gap {worst:.1e}")
            bad += bool(diff)
    print(f"ds_schedules: {len(CASES) - bad} of {len(CASES)} schedules equal to DeepSpeed's for "
          f"{steps} steps")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
