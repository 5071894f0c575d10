#!/usr/bin/env python3
"""ds_aio_bench.py - one timed read or write of a whole file through DeepSpeed's async IO
handle (deepspeed.ops.aio, the engine behind ds_io and ZeRO-Infinity's swapper), the way
ds_io drives it: one page-locked buffer from the handle, pread/pwrite of the whole file,
wait. Writes are followed by os.fdatasync inside the timing, as `zinf bench` times its own.

The bytes are zinf bench's pattern (tools/cmd_bench_run.c: page_key), so the read of a file
that `zinf bench --keep` wrote is verified word for word, and a written file is read back
and checked after the timing.

    ds_aio_bench.py --file F --op read|write --block-size B --queue-depth Q [--size N]

Prints one JSON object: {"engine": "deepspeed", "op", "bytes", "block_size", "queue_depth",
"seconds", "GBps", "verified"}. Exit status 1 when the bytes are wrong. Run by
bench/io_vs_deepspeed.sh; not part of the test suite.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from deepspeed.ops.op_builder import AsyncIOBuilder

PATTERN_SEED = 0x7A696E66
PAGE = 4096
M64 = (1 << 64) - 1


def pattern(nbytes):
    """The words zinf bench writes: page_key(offset of the page) + word index."""
    with np.errstate(over="ignore"):
        pages = np.arange(nbytes // PAGE, dtype=np.uint64)
        z = (pages * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(PATTERN_SEED)
        z = (z ^ (z >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
        z = z ^ (z >> np.uint64(29))
        words = z[:, None] + np.arange(PAGE // 8, dtype=np.uint64)[None, :]
    return words.reshape(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True)
    ap.add_argument("--op", choices=["read", "write"], required=True)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--size", type=int, default=0, help="bytes (write); read: the file's size")
    ap.add_argument("--single-submit", action="store_true")
    ap.add_argument("--intra-op-parallelism", type=int, default=1)
    a = ap.parse_args()

    nbytes = os.path.getsize(a.file) if a.op == "read" else a.size
    if nbytes <= 0 or nbytes % PAGE:
        sys.exit("ds_aio_bench.py: the size must be a positive multiple of 4 KiB")
    aio = AsyncIOBuilder().load(verbose=False)
    # (block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism), as
    # ds_io passes them; overlap_events is DeepSpeed's default (true).
    h = aio.aio_handle(a.block_size, a.queue_depth, a.single_submit, True, a.intra_op_parallelism)
    buf = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    want = pattern(nbytes)
    view = buf.numpy().view(np.uint64)
    if a.op == "write":
        view[:] = want
        if os.path.exists(a.file):
            os.remove(a.file)  # as ds_io does: never time an overwrite in place
    else:
        view[:] = 0
        fd = os.open(a.file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    t0 = time.perf_counter()
    if a.op == "read":
        r = h.pread(buf, a.file, False, True)
    else:
        r = h.pwrite(buf, a.file, False, True)
    if r == -1:
        sys.exit("ds_aio_bench.py: the handle refused the request")
    h.wait()
    if a.op == "write":
        fd = os.open(a.file, os.O_WRONLY)
        os.fdatasync(fd)
        os.close(fd)
    seconds = time.perf_counter() - t0

    if a.op == "read":
        ok = bool(np.array_equal(view, want))
    else:
        back = np.fromfile(a.file, dtype=np.uint64)
        ok = back.size == want.size and bool(np.array_equal(back, want))
    h.free_cpu_locked_tensor(buf)
    print(json.dumps({"engine": "deepspeed", "op": a.op, "bytes": nbytes,
                      "block_size": a.block_size, "queue_depth": a.queue_depth,
                      "seconds": round(seconds, 6), "GBps": round(nbytes / seconds / 1e9, 4),
                      "verified": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
