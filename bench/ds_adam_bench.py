#!/usr/bin/env python3
"""ds_adam_bench.py - elements per second of DeepSpeed's CPU AdamW (deepspeed.ops.adam
DeepSpeedCPUAdam, the optimizer ZeRO-Offload runs on the host; its cpu_adam op is built by
DeepSpeed's op builder on first use), on the arrays bench/adamw times zinf's AdamW on.

One fp32 parameter of ELEMS elements with an fp32 gradient, fp32 optimizer states, filled
as bench/adamw fills them (param in [-1, 1), grad 0.01 x that, exp_avg 0.001 x that,
exp_avg_sq 1e-5 x (1 + that); the states are put in the optimizer's state before its first
step, so no step starts from zeros), and bench/adamw's hyperparameters: lr 1e-4, betas
(0.9, 0.95), eps 1e-8, weight_decay 0.1, bias correction, adamw_mode=True (decoupled decay,
as zinf's). Threads: OMP_NUM_THREADS and torch.set_num_threads(N), set before torch loads.
WARMUP steps untimed, then REPS timed optimizer.step() calls, each alone; reports the best
and the median. Like bench/adamw, 28 bytes move per element (param, grad, exp_avg,
exp_avg_sq read; param, exp_avg, exp_avg_sq written).

Checked after timing: on 4096 sampled elements (the first, the last, the rest at random)
every step that ran is replayed in float64 with the same formula, and the result must be
within 1e-5 of it relative to each array's largest value (as bench/adamw measures its own
error, max|diff| / max|value|; the gap is fp32 rounding).

    ds_adam_bench.py [--elems 64M] [--threads N] [--reps 10] [--warmup 2]

Prints one JSON object: {"engine": "deepspeed-cpu_adam", "elements", "threads", "reps",
"best_ms", "median_ms", "best_gelem_per_s", "median_gelem_per_s", "gbps" (of the best),
"simd", "march", "max_rel_err", "verified"}; simd is the -D__X__ width macro in the built
op's build.ninja when it can be read, else what the builder would pass. Exit status 1 when
the check fails. Run by bench/adamw_vs_deepspeed.sh; not part of the test suite.
"""
import argparse
import json
import os
import re
import statistics
import sys
import time


def count_arg(s):
    m = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)([kKmMgG]?)", s)
    if not m:
        raise argparse.ArgumentTypeError(f"bad count '{s}'")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


ap = argparse.ArgumentParser()
ap.add_argument("--elems", type=count_arg, default=64 << 20)
ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
ap.add_argument("--reps", type=int, default=10)
ap.add_argument("--warmup", type=int, default=2)
a = ap.parse_args()
os.environ["OMP_NUM_THREADS"] = str(a.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: E402
from deepspeed.ops.op_builder import CPUAdamBuilder  # noqa: E402

LR, BETA1, BETA2, EPS, WD = 1e-4, 0.9, 0.95, 1e-8, 0.1
SAMPLE = 4096
BYTES_PER_ELEM = 28


def simd_of_build():
    b = CPUAdamBuilder()
    want = b.simd_width()
    try:
        from torch.utils.cpp_extension import _get_build_directory
        with open(os.path.join(_get_build_directory(b.NAME, False), "build.ninja")) as f:
            m = re.search(r"-D__(AVX512|AVX256|SCALAR|SVE|NEON)__", f.read())
        if m:
            return m.group(1), b.cpu_arch()
    except Exception:
        pass
    return want.strip("-D_"), b.cpu_arch()


def main():
    torch.set_num_threads(a.threads)
    n = a.elems
    rng = np.random.default_rng(12345)

    def urand(scale):
        return torch.from_numpy((rng.random(n, dtype=np.float32) * 2 - 1) * np.float32(scale))

    p = torch.nn.Parameter(urand(1.0))
    p.grad = urand(0.01)
    m = urand(0.001)
    v = (urand(1.0) + 1) * 1e-5
    idx = np.concatenate(([0, n - 1], rng.integers(0, n, SAMPLE - 2)))
    saved = [t.detach().numpy()[idx].astype(np.float64) for t in (p, p.grad, m, v)]

    opt = DeepSpeedCPUAdam([p], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD,
                           bias_correction=True, adamw_mode=True)
    opt.state[p] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
    for _ in range(a.warmup):
        opt.step()
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    steps = opt.state[p]["step"]

    # The same steps in float64 on the sample: PyTorch's AdamW formula, as DeepSpeed and
    # zinf compute it (decay on the parameter, then the bias-corrected update).
    P, G, M, V = saved
    for t in range(1, steps + 1):
        M = BETA1 * M + (1 - BETA1) * G
        V = BETA2 * V + (1 - BETA2) * G * G
        P = P * (1 - LR * WD) - LR * (M / (1 - BETA1 ** t)) / (np.sqrt(V / (1 - BETA2 ** t)) + EPS)
    err = 0.0
    for got, want in ((p.detach(), P), (opt.state[p]["exp_avg"], M), (opt.state[p]["exp_avg_sq"], V)):
        g = got.numpy()[idx].astype(np.float64)
        err = max(err, float(np.max(np.abs(g - want)) / np.max(np.abs(want))))
    ok = bool(np.isfinite(err) and err <= 1e-5)

    best, med = min(times), statistics.median(times)
    simd, march = simd_of_build()
    print(json.dumps({"engine": "deepspeed-cpu_adam", "elements": n, "threads": a.threads,
                      "torch_threads": torch.get_num_threads(), "reps": a.reps,
                      "warmup": a.warmup, "best_ms": round(best * 1e3, 3),
                      "median_ms": round(med * 1e3, 3),
                      "best_gelem_per_s": round(n / best / 1e9, 4),
                      "median_gelem_per_s": round(n / med / 1e9, 4),
                      "gbps": round(BYTES_PER_ELEM * n / best / 1e9, 3), "simd": simd,
                      "march": march, "max_rel_err": float("%.3g" % err), "verified": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
