#!/usr/bin/env python3
"""ds_optim.py - zinf's Adam with adam_w_mode false and its LAMB against DeepSpeed's, on the
same tensor and gradients, for scripts/check-deepspeed.sh.

Adam (L2 weight decay in the gradient): DeepSpeedCPUAdam(adamw_mode=False) (its C++ op,
built by DeepSpeed on first use) against zinf's kernel (bench/optim_ref), several steps.

LAMB: DeepSpeed's is FusedLamb, a CUDA op. Where it loads (a GPU), it runs; where it does not,
its kernel's arithmetic (deepspeed/ops/csrc/lamb/fused_lamb_cuda_kernel.cu: part 1 the
moments and the two norms, part 3 the trust ratio clamped to [min_coeff, max_coeff] and the
update with step size lr sqrt(1 - beta2^t) / (1 - beta1^t)) is evaluated in fp32 with torch,
operation for operation, and the summary says which it was. Three cases: the ratio within
its bounds, clamped at max_coeff, clamped at min_coeff.

The parameters and moments must agree to fp32 rounding: the largest difference is reported in
units of the fp32 spacing (ulp) at the tensor's largest magnitude, and must be within a few;
the trust ratios to 1e-6.

    ds_optim.py OPTIM_REF_BINARY [N] [STEPS]     (default 1048576 elements, 5 steps)
"""
import subprocess
import sys

import numpy as np
import torch

RTOL_ULPS = 4  # fp32 spacings allowed: the same operations, rounded in another order


def zinf_run(binary, kind, p, m, v, grads, args):
    n = p.size
    inp = b"".join(x.astype(np.float32).tobytes() for x in [p, m, v] + grads)
    out = subprocess.run([binary, kind, str(n), str(len(grads))] + [str(a) for a in args],
                         input=inp, capture_output=True, check=True).stdout
    f = np.frombuffer(out, dtype=np.float32)
    return f[:n], f[n:2 * n], f[2 * n:3 * n], f[3 * n:]


def ulps(a, b):
    """The largest |a - b| in units of the fp32 spacing at the tensor's largest magnitude
    (an element near 0 is the difference of larger terms, whose rounding it carries)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.max(np.abs(a - b)) / np.spacing(np.float32(np.max(np.abs(b)))))


def ds_adam_l2(p, grads, lr, b1, b2, eps, wd):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    t = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = DeepSpeedCPUAdam([t], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                           adamw_mode=False, bias_correction=True)
    for g in grads:
        t.grad = torch.from_numpy(g.copy())
        opt.step()
    st = opt.state[t]
    return t.detach().numpy(), st["exp_avg"].numpy(), st["exp_avg_sq"].numpy()


def lamb_kernel_fp32(p, grads, lr, b1, b2, eps, wd, max_c, min_c, bias_correction, eps_inside):
    """FusedLamb's CUDA kernel, element by element in fp32 (grad_scale 1)."""
    f = torch.float32
    p, m, v = (torch.from_numpy(p.copy()), torch.zeros(p.size, dtype=f),
               torch.zeros(p.size, dtype=f))
    b1f, b2f, epsf, wdf = (torch.tensor(x, dtype=f) for x in (b1, b2, eps, wd))
    coeffs = []
    for step, g in enumerate(grads, 1):
        sg = torch.from_numpy(g.copy()) / torch.tensor(1.0, dtype=f)
        m = b1f * m + (1 - b1f) * sg
        v = b2f * v + (1 - b2f) * sg * sg
        denom = torch.sqrt(v + epsf) if eps_inside else torch.sqrt(v) + epsf
        update = m / denom + wdf * p
        w_norm = torch.sqrt(torch.sum(p.double() * p.double())).float()
        u_norm = torch.sqrt(torch.sum(update.double() * update.double())).float()
        coeff = torch.tensor(1.0, dtype=f)
        if w_norm != 0 and u_norm != 0:
            coeff = torch.clamp(w_norm / u_norm, max=max_c)
            coeff = torch.clamp(coeff, min=min_c)
        if bias_correction:
            bc1 = np.float32(1 - pow(b1, step))  # std::pow(float, int) in double, as float
            bc2 = np.float32(1 - pow(np.float32(b2), step))
            step_size = np.float32(np.float32(lr) * np.sqrt(bc2) / bc1)
        else:
            step_size = np.float32(lr)
        p = p - (torch.tensor(step_size, dtype=f) * coeff) * update
        coeffs.append(float(coeff))
    return p.numpy(), m.numpy(), v.numpy(), coeffs


def fused_lamb(p, grads, lr, b1, b2, eps, wd, max_c, min_c, bias_correction, eps_inside):
    from deepspeed.ops.lamb import FusedLamb
    t = torch.nn.Parameter(torch.from_numpy(p.copy()).cuda())
    opt = FusedLamb([t], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, max_coeff=max_c,
                    min_coeff=min_c, bias_correction=bias_correction, eps_inside_sqrt=eps_inside)
    coeffs = []
    for g in grads:
        t.grad = torch.from_numpy(g.copy()).cuda()
        opt.step()
        coeffs += opt.get_lamb_coeffs()
    st = opt.state[t]
    return (t.detach().cpu().numpy(), st["exp_avg"].cpu().numpy(),
            st["exp_avg_sq"].cpu().numpy(), coeffs)


def main():
    binary = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    rng = np.random.default_rng(7)
    p = rng.standard_normal(n).astype(np.float32) * 0.02
    grads = [rng.standard_normal(n).astype(np.float32) * 0.01 for _ in range(steps)]
    zeros = np.zeros(n, dtype=np.float32)
    bad = 0

    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    zp, zm, zv, _ = zinf_run(binary, "adam-l2", p, zeros, zeros, grads,
                             [lr, b1, b2, eps, wd, 1])
    dp, dm, dv = ds_adam_l2(p, grads, lr, b1, b2, eps, wd)
    worst = max(ulps(zp, dp), ulps(zm, dm), ulps(zv, dv))
    ok = worst <= RTOL_ULPS
    bad += not ok
    print(f"Adam adam_w_mode false vs DeepSpeedCPUAdam: {n} elements, {steps} steps, "
          f"param/m/v within {worst:.1f} ulp: {'ok' if ok else 'DIFFER'}")

    try:
        import deepspeed.ops.lamb  # noqa: F401
        from deepspeed.ops.op_builder import FusedLambBuilder
        FusedLambBuilder().load()
        ref, which = fused_lamb, "FusedLamb (its CUDA op)"
    except Exception as e:  # no GPU or no CUDA torch: the kernel's arithmetic instead
        ref = lamb_kernel_fp32
        which = ("FusedLamb's kernel arithmetic in fp32 (its CUDA op does not load here: "
                 f"{type(e).__name__})")
    for name, wd, max_c, min_c, bc, inside in [
            ("within its bounds", 0.01, 10.0, 0.001, True, False),
            ("clamped at max_coeff", 0.01, 0.003, 0.001, True, False),
            ("clamped at min_coeff, bias_correction false, eps_inside_sqrt", 0.0, 10.0, 0.5,
             False, True)]:
        zp, zm, zv, zc = zinf_run(binary, "lamb", p, zeros, zeros, grads,
                                  [lr, b1, b2, eps, wd, int(bc), max_c, min_c, int(inside)])
        dp, dm, dv, dc = ref(p, grads, lr, b1, b2, eps, wd, max_c, min_c, bc, inside)
        worst = max(ulps(zp, dp), ulps(zm, dm), ulps(zv, dv))
        cgap = max(abs(a - b) / abs(b) for a, b in zip(zc, dc))
        ok = worst <= RTOL_ULPS and cgap <= 1e-6
        bad += not ok
        print(f"Lamb ({name}) vs {which}: {n} elements, {steps} steps, param/m/v within "
              f"{worst:.1f} ulp, trust ratios {[round(float(c), 6) for c in zc]} (relative gap "
              f"{cgap:.1e}): {'ok' if ok else 'DIFFER'}")
    print(f"ds_optim: {4 - bad} of 4 optimizer checks within fp32 rounding of DeepSpeed's")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
