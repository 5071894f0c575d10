#!/usr/bin/env python3
"""zinf's 8-bit Adam states (src/train/adamw_states.c) against bitsandbytes itself, where
bitsandbytes is installed (pip install bitsandbytes: its CPU build runs the blockwise
quantizer on the CPU). Not part of meson's tests: bitsandbytes and torch are no dependency.

It compiles adamw.c and adamw_states.c into a small shared library in a scratch folder,
then compares, through ctypes:
  - the dynamic maps with create_dynamic_map(signed=True) and (signed=False), value by value;
  - quantize_blockwise(x, code, blocksize=256) on values over eight decades, signed (m) and
    non-negative (v): the absmax per block and each code. Its CPU backend has two paths: a
    float64 input takes the plain one (argmin of |x / absmax - code| over the codes: the
    nearest code, as the CUDA kernels and the default backend's bucketize on the midpoints
    choose), which is the reference here; the native fp32 kernel's codes are reported beside
    (its search does not find the nearest code for values far below the block's absmax);
  - dequantize_blockwise of those codes.
Exit 0 when the maps are within 2 float ulps, every absmax equal and at least 99.9% of the
codes equal to the reference's, the others neighbours (a value within an ulp of the midpoint
between two codes: the two divide by absmax in different precisions).

Usage: bnb_q8_check.py SOURCE_ROOT [CC]
"""
import ctypes
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import bitsandbytes.functional as F


def build(root, cc):
    out = tempfile.mkdtemp(prefix="q8check")
    so = os.path.join(out, "libq8.so")
    src = [os.path.join(root, "src/train", f) for f in ("adamw.c", "adamw_states.c")]
    subprocess.run([cc, "-std=gnu11", "-O2", "-fPIC", "-shared", "-fopenmp", "-pthread",
                    "-I" + os.path.join(root, "src"), "-I" + os.path.join(root, "include"),
                    *src, "-lm", "-o", so], check=True)
    lib = ctypes.CDLL(so)
    lib.adamw_q8_map.restype = ctypes.POINTER(ctypes.c_float)
    lib.adamw_q8_quantize.restype = None
    lib.adamw_q8_dequantize.restype = None
    return lib


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    lib = build(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cc")
    ok = True
    fp = ctypes.POINTER(ctypes.c_float)
    up = ctypes.POINTER(ctypes.c_uint8)
    for signed in (1, 0):
        ours = np.ctypeslib.as_array(lib.adamw_q8_map(signed), shape=(256,)).copy()
        theirs = F.create_dynamic_map(signed=bool(signed)).numpy().astype(np.float32)
        ulps = np.abs(ours.view(np.int32).astype(np.int64) -
                      theirs.view(np.int32).astype(np.int64))
        same = int((ours == theirs).sum())
        print(f"map signed={signed}: {same}/256 values bitwise equal, most "
              f"{int(ulps.max())} ulps apart, max |diff| {np.abs(ours - theirs).max():.3g}")
        ok &= int(ulps.max()) <= 2

        rng = np.random.default_rng(7 + signed)
        n = 256 * 64 + 100
        mag = (10.0 ** rng.uniform(-8, 0, n)).astype(np.float32)
        x = rng.standard_normal(n).astype(np.float32) * mag
        if not signed:
            x = np.abs(x)
        code = torch.from_numpy(theirs)
        codes = np.zeros(n, np.uint8)
        absmax = np.zeros((n + 255) // 256, np.float32)
        lib.adamw_q8_quantize(x.ctypes.data_as(fp), ctypes.c_size_t(n), ctypes.c_int(signed),
                              codes.ctypes.data_as(up), absmax.ctypes.data_as(fp))
        # the op itself: quantize_blockwise() takes 16- and 32-bit floats only
        ref_q, ref_abs = torch.ops.bitsandbytes.quantize_blockwise(
            torch.from_numpy(x.astype(np.float64)), code, 256)
        rq, rabs = ref_q.numpy(), ref_abs.numpy().astype(np.float32)
        diff = codes != rq
        near = np.abs(codes.astype(int) - rq.astype(int)) <= 1
        print(f"quantize_blockwise signed={signed} (nearest code): absmax equal "
              f"{bool((absmax == rabs).all())}, codes equal {n - int(diff.sum())}/{n}, "
              f"differing ones neighbours {bool(near.all())}")
        ok &= bool((absmax == rabs).all()) and diff.sum() <= n / 1000 and bool(near.all())
        q, st = F.quantize_blockwise(torch.from_numpy(x), code=code, blocksize=256)
        tq, tabs = q.numpy(), st.absmax.numpy()
        big = np.abs(x / np.repeat(absmax, 256)[:n]) >= 1e-2
        print(f"  native fp32 kernel: absmax equal {bool((absmax == tabs).all())}, codes equal "
              f"{int((codes == tq).sum())}/{n}; where |x| >= absmax / 100: "
              f"{int((codes == tq)[big].sum())}/{int(big.sum())}")
        back = F.dequantize_blockwise(q, st).numpy()
        mine = np.zeros(n, np.float32)
        lib.adamw_q8_dequantize(tq.ctypes.data_as(up), tabs.ctypes.data_as(fp), ctypes.c_size_t(n),
                                ctypes.c_int(signed), mine.ctypes.data_as(fp))
        dd = np.abs(back - mine).max()
        print(f"dequantize_blockwise signed={signed}: max |diff| {dd:.3g}")
        ok &= dd <= 2 * np.finfo(np.float32).eps * np.abs(back).max()
    print("bitsandbytes", __import__("bitsandbytes").__version__, "agrees" if ok else "DIFFERS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
