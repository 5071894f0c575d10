#!/usr/bin/env python3
"""step_breakdown.py - where the time of each step of a `zinf train --trace` run goes: the
step's span, its forward, backward and optimizer phases (the trainer's spans), the time the
main thread spent in the engine's fetches to the host and to the device, and, for the
optimizer, how much of it the large tensors (the block matrices) took against the small ones.
With the update deferred to the next forward, `in_fwd` is the time of the updates inside the
forward's blocks (counted in `forward` too), and the optimizer phase is gone.

    step_breakdown.py TRACE.json [FIRST_STEP]     (default 2: step 1 learns the schedule)
"""
import json
import sys


def main():
    ev = json.load(open(sys.argv[1]))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    spans = [e for e in ev if e.get("ph") == "X"]
    steps = [e for e in spans if e["name"].startswith("step ")
             and int(e["name"].split()[1]) >= first]
    print("# step   total_ms  forward  (in_fwd)  backward  optimizer (large/small)  fetch_host  "
          "fetch_device")
    for st in steps:
        a, b = st["ts"], st["ts"] + st["dur"]
        inn = [e for e in spans if a <= e["ts"] < b]

        def ms(pred):
            return sum(e["dur"] for e in inn if pred(e)) / 1e3
        opt = [e for e in inn if e["name"] == "optimizer"]
        big = sum(e["dur"] for e in opt if e.get("args", {}).get("bytes", 0) >= 1 << 20) / 1e3
        print("  %4s %10.0f %8.0f %9.0f %9.0f %10.0f (%.0f/%.0f) %11.0f %13.0f" % (
            st["name"].split()[1], st["dur"] / 1e3,
            ms(lambda e: e["name"].startswith("block forward")),
            ms(lambda e: e["name"] == "update before its forward"),
            ms(lambda e: e["name"].startswith("block backward")),
            ms(lambda e: e["name"] == "optimizer"), big, ms(lambda e: e["name"] == "optimizer") - big,
            ms(lambda e: e["name"] == "fetch to host"),
            ms(lambda e: e["name"] == "fetch to device")))


if __name__ == "__main__":
    main()
