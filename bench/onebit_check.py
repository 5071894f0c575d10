#!/usr/bin/env python3
"""onebit_check.py - zinf's 1-bit Adam against DeepSpeed's arithmetic, for
scripts/check-onebit.sh.

DeepSpeed's OnebitAdam.step (deepspeed/runtime/fp16/onebit/adam.py) and its
compressed_allreduce (deepspeed/runtime/comm/nccl.py) are transcribed below in numpy, in fp32,
operation for operation: the warm-up's Adam without bias correction on the ranks' mean
gradient, then each rank's momentum of its own gradient, padded to a multiple of
world x lcm(world, 8), its worker error added, compressed to signs (>= 0: +1) and one scale
|x| / sqrt(N), the server's chunk the sum of the ranks' sign x scale / world plus its server
error, compressed the same way, and the update p -= lr (m / (sqrt(v) + eps) + wd p).
DeepSpeed's first step() only sets up its buffers (the gradient is dropped, the step counted):
its call s + 1 is zinf's update s, which is what is transcribed.

zinf's side is bench/onebit_ref (train/onebit.c's functions, W ranks in one process). The
parameters, momentum and both errors must agree to fp32 rounding: the norms are summed in
another order (zinf in double, torch in fp32), so the scales differ in their last bits; the
largest difference is reported in units of the fp32 spacing at the tensor's largest
magnitude, and every sign must agree.

    onebit_check.py ONEBIT_REF_BINARY
"""
import subprocess
import sys

import numpy as np

F = np.float32
ULPS = 64  # the scales' last bits, carried through a few steps of error feedback


def lcm8(w):
    return w * 8 // np.gcd(w, 8)


def zinf_run(binary, W, n, steps, freeze, hp, p0, grads):
    inp = p0.tobytes() + b"".join(g.astype(F).tobytes() for g in grads)
    args = [binary, str(W), str(n), str(steps), str(freeze)] + [repr(float(x)) for x in hp]
    out = np.frombuffer(subprocess.run(args, input=inp, capture_output=True, check=True).stdout,
                        dtype=F)
    N = -(-n // (W * lcm8(W))) * (W * lcm8(W))
    p, m, v = out[:n], out[n:2 * n], out[2 * n:3 * n]
    werr = out[3 * n:3 * n + W * N].reshape(W, N)
    serr = out[3 * n + W * N:].reshape(W, N // W)
    return p, m, v, werr, serr


def sign_pm(x):
    """DeepSpeed's x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0): +1 where x >= 0."""
    return np.where(np.sign(x) + 1 != 0, F(1), F(-1))


def compressed_allreduce(ms, werr, serr, W):
    """nccl.py's compressed_allreduce for the W ranks' momenta ms: the result on every rank."""
    n = ms[0].size
    N = werr[0].size
    chunk = N // W
    signs, scales = [], []
    for w in range(W):
        buf = np.concatenate([ms[w], np.zeros(N - n, F)]) + werr[w]
        ws = F(np.linalg.norm(buf) / np.sqrt(buf.size))
        werr[w] = buf - ws * sign_pm(buf)
        signs.append(sign_pm(buf))
        scales.append(ws)
    ssigns, sscales = [], []
    for r in range(W):
        recv = np.stack([signs[w][r * chunk:(r + 1) * chunk] for w in range(W)])
        per = (np.array(scales, F) * F(1 / W)).reshape(W, 1)
        c = (recv * per).sum(0, dtype=F) + serr[r]
        ss = F(np.linalg.norm(c) / np.sqrt(c.size))
        serr[r] = c - ss * sign_pm(c)
        ssigns.append(sign_pm(c))
        sscales.append(ss)
    out = np.concatenate([ssigns[r] * sscales[r] for r in range(W)])
    return out[:n]


def deepspeed_run(W, n, steps, freeze, hp, p0, grads):
    lr, b1, b2, eps, wd = (F(x) for x in hp)
    p = p0.copy()
    m = np.zeros(n, F)
    v = np.zeros(n, F)
    N = -(-n // (W * lcm8(W))) * (W * lcm8(W))
    werr = [np.zeros(N, F) for _ in range(W)]
    serr = [np.zeros(N // W, F) for _ in range(W)]
    ms = None
    for s in range(1, steps + 1):
        g = grads[s - 1]
        if s <= freeze:
            # The engine's allreduce, then its division by the world.
            gm = g.sum(0, dtype=F) * F(1 / W)
            m = m * b1 + F(1 - b1) * gm
            v = v * b2 + F(1 - b2) * gm * gm
        else:
            if ms is None:
                ms = [m.copy() for _ in range(W)]
            for w in range(W):
                ms[w] = ms[w] * b1 + F(1 - b1) * g[w]
            if W > 1:
                res = compressed_allreduce(ms, werr, serr, W)
                ms = [res.copy() for _ in range(W)]
            m = ms[0]
        update = m / (np.sqrt(v) + eps)
        if wd > 0:
            update = update + wd * p
        p = p - lr * update
    return p, m, v, werr, serr


def ulps(a, b):
    scale = max(float(np.max(np.abs(a))), float(np.max(np.abs(b))), 1e-30)
    return float(np.max(np.abs(a.astype(np.float64) - b))) / float(np.spacing(F(scale)))


def main():
    binary = sys.argv[1]
    rng = np.random.default_rng(7)
    ok = True
    # (ranks, elements, steps, freeze_step, lr, beta1, beta2, eps, weight_decay)
    cases = [(2, 1000, 8, 3, 1e-3, 0.9, 0.999, 1e-8, 0.0),
             (3, 4099, 10, 4, 1e-3, 0.9, 0.99, 1e-8, 0.01),
             (4, 777, 12, 2, 5e-4, 0.8, 0.95, 1e-6, 0.1),
             (1, 500, 6, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0)]
    for W, n, steps, freeze, *hp in cases:
        p0 = rng.standard_normal(n).astype(F)
        grads = [rng.standard_normal((W, n)).astype(F) * F(0.1) for _ in range(steps)]
        z = zinf_run(binary, W, n, steps, freeze, hp, p0, grads)
        d = deepspeed_run(W, n, steps, freeze, hp, p0, grads)
        worst = 0.0
        parts = []
        for name, a, b in zip(["param", "m", "v", "worker error", "server error"], z, d):
            a = np.asarray(a, F).ravel()
            b = np.concatenate([np.ravel(x) for x in b]) if isinstance(b, list) else b.ravel()
            if a.size == 0 and b.size == 0:
                continue
            u = ulps(a, b)
            worst = max(worst, u)
            parts.append(f"{name} {u:.1f}")
        flips = int(np.sum(np.sign(z[1]) != np.sign(d[1])))
        good = worst <= ULPS and flips == 0
        ok &= good
        print(f"onebit W={W} n={n} steps={steps} freeze_step={freeze} lr={hp[0]} betas=({hp[1]}, "
              f"{hp[2]}) eps={hp[3]} wd={hp[4]}: largest difference in fp32 spacings: "
              f"{', '.join(parts)}; momentum signs differing: {flips}: "
              f"{'ok' if good else 'NOT ok'}")
    print("onebit_check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
