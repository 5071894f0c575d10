#!/usr/bin/env python3
"""ds_swapper_bench.py - swap-in the way DeepSpeed's ZeRO-Infinity parameter swapper does it
(deepspeed/runtime/swap_tensor/partitioned_param_swapper.py, AsyncPartitionedParameterSwapper),
timed per step like bench/swapin times zinf's.

Setup, untimed: one swap file per parameter (default 64 parameters x 32 MiB, the same tensors
as bench/swapin's default), in DIR/zero_stage_3/float16params/rank0/<id>_param.tensor.swp as
the swapper names them (the folder is emptied first, as the swapper does), each written with
bench/bench_util.h's pattern for that parameter (word j of page p of parameter i is
page_key(i, p) + j) through a second aio handle, async_pwrite + wait, as the swapper's
aio_write_handle writes them. Two buffer sets of BATCH page-locked buffers (default 2 x 4)
are narrowed from one tensor that aio_handle.new_cpu_locked_tensor() allocates, as the
swapper allocates its buffer pool; the destination "device" tensors are preallocated and
touched before timing (CUDA when torch sees a GPU and --device is auto, else host memory).

Each timed step reads every parameter in order, in batches of BATCH: batch 0 is submitted,
then for each batch k: wait() (asserting that it completed as many ops as were submitted,
as synchronize_reads() does), submit batch k+1 into the other set, and copy batch k from
its set into its destination tensors while batch k+1 is read. The reads are
swap_in_tensors(): one async_pread(buffer, path, 0) per parameter. Inside the timing, after
each copy, 3 pages of 4 KiB of the destination are checked (first, last, and
page_key(step, i) mod pages, the ones bench/swapin checks). Steps are independent: a step
starts with nothing in flight.

The handle is aio_handle(block_size, queue_depth, single_submit, overlap_events,
intra_op_parallelism) with the swapper's keyword arguments; the defaults here are 1 MiB,
32, False, True, 1 (DeepSpeed's own aio defaults but for queue depth 8, raised to the 32
that bench/swapin uses by default). DeepSpeed opens the files with O_DIRECT.

Checked against DeepSpeed 0.19.8's source (runtime/swap_tensor/partitioned_param_swapper.py,
utils.py, ops/csrc/aio): the swapper builds its read and write handles with these keyword
arguments from its aio config, allocates its buffers with one new_cpu_locked_tensor() of
buffer_count x aligned elements and narrows them, swaps in with swap_in_tensors()
(async_pread(buffer, path, 0) per tensor, asserted == 0) and completes with
synchronize_reads() (assert pending == wait()); these are the calls made here. What is not
DeepSpeed's own code is the schedule around them (two sets of BATCH buffers, read ahead by
one batch), which stands in for ZeRO-3's parameter prefetch, and the copy to the device
tensor, which stands in for the use of the swapped-in buffer.

    ds_swapper_bench.py --path DIR [--params 64] [--param-size 32M] [--batch 4] [--steps 5]
        [--block-size 1M] [--queue-depth 32] [--single-submit] [--no-overlap-events]
        [--intra-op-parallelism 1] [--device auto|cpu|cuda] [--keep]

Prints one JSON object: per-step seconds and GB/s (tensor bytes / step wall time, 10^9 B/s),
the median GB/s of steps 2..N, the handle's parameters and "verified". Exit status 1 when a
page is wrong. Run by bench/swap_vs_deepspeed.sh; not part of the test suite.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time

import numpy as np
import torch
from deepspeed.ops.op_builder import AsyncIOBuilder

PAGE = 4096
WORDS = PAGE // 8
M64 = (1 << 64) - 1


def page_key(tid, page):
    """bench/bench_util.h page_key(), on Python ints."""
    z = ((((tid << 40) ^ page) * 0x9E3779B97F4A7C15) & M64) ^ 0x7A696E66
    z = ((z ^ (z >> 31)) * 0xBF58476D1CE4E5B9) & M64
    return z ^ (z >> 29)


def pattern(tid, nbytes):
    """All words of parameter tid, as pattern_fill() writes them."""
    with np.errstate(over="ignore"):
        z = (np.uint64(tid) << np.uint64(40)) ^ np.arange(nbytes // PAGE, dtype=np.uint64)
        z = (z * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(0x7A696E66)
        z = (z ^ (z >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
        z = z ^ (z >> np.uint64(29))
        return (z[:, None] + np.arange(WORDS, dtype=np.uint64)[None, :]).reshape(-1)


def size_arg(s):
    m = re.fullmatch(r"([0-9.]+)([kKmMgG]?)(i?[bB])?", s)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size '{s}'")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--params", type=int, default=64)
    ap.add_argument("--param-size", type=size_arg, default=32 << 20, help="bytes per parameter")
    ap.add_argument("--batch", type=int, default=4, help="parameters per batch (buffers per set)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--block-size", type=size_arg, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--single-submit", action="store_true")
    ap.add_argument("--no-overlap-events", action="store_true")
    ap.add_argument("--intra-op-parallelism", type=int, default=1)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--keep", action="store_true", help="keep the swap files")
    a = ap.parse_args()
    if a.param_size <= 0 or a.param_size % PAGE or a.params < 1 or a.batch < 1 or a.steps < 1:
        sys.exit("ds_swapper_bench.py: sizes must be positive multiples of 4 KiB, counts >= 1")
    dev = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev == "cuda"

    aio = AsyncIOBuilder().load(verbose=False)
    kw = dict(block_size=a.block_size, queue_depth=a.queue_depth, single_submit=a.single_submit,
              overlap_events=not a.no_overlap_events, intra_op_parallelism=a.intra_op_parallelism)
    rh = aio.aio_handle(**kw)  # the swapper's aio_read_handle
    wh = aio.aio_handle(**kw)  # and its aio_write_handle

    dtype = torch.float16  # the swapper's buffers are of the model's dtype
    numel = a.param_size // 2
    nbuf = 2 * a.batch
    pool = rh.new_cpu_locked_tensor(numel * nbuf, torch.empty(0, dtype=dtype))
    bufs = [pool.narrow(0, b * numel, numel) for b in range(nbuf)]

    folder = os.path.join(a.path, "zero_stage_3", "float16params", "rank0")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"{i}_param.tensor.swp") for i in range(a.params)]

    # Swap-out, untimed: each parameter's pattern through the write handle.
    for i, p in enumerate(paths):
        bufs[0].numpy().view(np.uint64)[:] = pattern(i, a.param_size)
        assert wh.async_pwrite(bufs[0], p, 0) == 0
        assert wh.wait() == 1

    dest = [torch.empty(numel, dtype=dtype, device=dev) for _ in range(a.params)]
    for d in dest:
        d.zero_()
    if cuda:
        torch.cuda.synchronize()

    npages = a.param_size // PAGE
    batches = [list(range(k, min(k + a.batch, a.params))) for k in range(0, a.params, a.batch)]
    arange = np.arange(WORDS, dtype=np.uint64)

    def submit(k):
        base = (k % 2) * a.batch
        for j, i in enumerate(batches[k]):  # swap_in_tensors()
            assert rh.async_pread(bufs[base + j], paths[i], 0) == 0

    def page_ok(d, i, page):
        want = np.uint64(page_key(i, page)) + arange
        w = d.narrow(0, page * (PAGE // 2), PAGE // 2)
        got = (w.cpu() if cuda else w).numpy().view(np.uint64)
        return bool(np.array_equal(got, want))

    rows, bad_pages = [], 0
    for s in range(a.steps):
        bad = 0
        t0 = time.perf_counter()
        submit(0)
        for k in range(len(batches)):
            assert rh.wait() == len(batches[k])  # synchronize_reads()
            if cuda:
                torch.cuda.synchronize()  # the copies out of the other set are done
            if k + 1 < len(batches):
                submit(k + 1)
            base = (k % 2) * a.batch
            for j, i in enumerate(batches[k]):
                dest[i].copy_(bufs[base + j], non_blocking=cuda)
            for i in batches[k]:
                for page in (0, npages - 1, page_key(s, i) % npages):
                    bad += not page_ok(dest[i], i, page)
        if cuda:
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        total = a.params * a.param_size
        rows.append({"step": s + 1, "seconds": round(sec, 6), "GBps": round(total / sec / 1e9, 4),
                     "bad_pages": bad})
        bad_pages += bad

    rh.free_cpu_locked_tensor(pool)
    if not a.keep:
        shutil.rmtree(os.path.join(a.path, "zero_stage_3"), ignore_errors=True)
    later = [r["GBps"] for r in rows[1:]] or [rows[0]["GBps"]]
    print(json.dumps({"engine": "deepspeed-swapper", "params": a.params, "param_bytes": a.param_size,
                      "bytes_per_step": a.params * a.param_size, "batch": a.batch, "buffer_sets": 2,
                      **kw, "device": dev, "steps": rows,
                      "median_GBps_after_first": round(statistics.median(later), 4),
                      "verify": "3 pages per parameter per step",
                      "verified": bad_pages == 0}))
    return 0 if bad_pages == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
