#!/usr/bin/env python3
"""py_fetch.py - what a fetch and release of a resident tensor costs from Python: the
extension's call (zinf.Engine.fetch, then Pinned.release), as a plain pair and as a `with`
block, on the host tier and on the device tier (emulated here; the copy is resident, so no
data moves). Prints the median, smallest and largest ns per pair of 31 rounds of 20,000
pairs each.

    PYTHONPATH=build/python python3 bench/py_fetch.py
"""
import statistics
import time

import zinf


def rounds(fn, n=20000, k=31):
    for _ in range(2000):
        fn()
    out = []
    for _ in range(k):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(out), min(out), max(out)


def main():
    with zinf.Engine(device="emulated", device_bytes=64 << 20, host_bytes=64 << 20) as e:
        th = e.register("h", 1 << 20, "host")
        td = e.register("d", 1 << 20, "device")
        e.fetch(td, "device").release()  # resident from here on

        def pair_host():
            e.fetch(th, "host").release()

        def with_host():
            with e.fetch(th, "host"):
                pass

        def pair_dev():
            e.fetch(td, "device").release()

        for name, fn in (("fetch+release, host tier", pair_host),
                         ("with fetch(), host tier", with_host),
                         ("fetch+release, device tier", pair_dev)):
            med, lo, hi = rounds(fn)
            print("%-28s median %6.0f ns per pair (min %.0f, max %.0f)" % (name, med, lo, hi))


if __name__ == "__main__":
    main()
