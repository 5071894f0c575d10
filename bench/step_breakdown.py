#!/usr/bin/env python3
"""step_breakdown.py - where the time of each step of a `zinf train --trace` run goes: the
step's span, its forward, backward and optimizer phases (the trainer's spans), the time the
main thread spent in the engine's fetches to the host and to the device, and, for the
optimizer, how much of it the large tensors (the block matrices) took against the small ones.
With the update deferred to the next forward, `in_fwd` is the time of the updates inside the
forward's blocks (counted in `forward` too), and the optimizer phase is gone.

    step_breakdown.py TRACE.json [FIRST_STEP]     (default 2: step 1 learns the schedule)
    step_breakdown.py --io TRACE.json [FIRST_STEP]

--io: the drive in each phase (forward, backward, optimizer, the whole step): the MB read
and written (the engine's counters), the share of the phase with at least one read or write
in flight (busy), with a read, with a write, and the mean number of each in flight. A
phase the drive was idle in for most of its time is IO that nothing forced to wait, or
that had no room to start.
"""
import bisect
import json
import sys


def io_intervals(ev):
    """The trace's NVMe reads and writes as (start, end) lists, by kind."""
    open_, out = {}, {"nvme read": [], "nvme write": []}
    for e in ev:
        if e.get("ph") in ("b", "e") and e.get("name") in out:
            key = (e["name"], e.get("id"))
            if e["ph"] == "b":
                open_[key] = e["ts"]
            elif key in open_:
                out[e["name"]].append((open_.pop(key), e["ts"]))
    return out["nvme read"], out["nvme write"]


def busy(ivs, a, b):
    """Of [a, b): the share covered by at least one interval, and the mean number open."""
    cut = sorted((max(x, a), min(y, b)) for x, y in ivs if y > a and x < b)
    covered, area, cur = 0.0, 0.0, None
    for x, y in cut:
        area += y - x
        if cur is None or x > cur[1]:
            if cur:
                covered += cur[1] - cur[0]
            cur = [x, y]
        else:
            cur[1] = max(cur[1], y)
    if cur:
        covered += cur[1] - cur[0]
    return covered / (b - a), area / (b - a)


def counter(ev, prefix):
    return sorted((e["ts"], e["args"]["value"]) for e in ev
                  if e.get("ph") == "C" and e.get("name", "").startswith(prefix))


def value_at(c, t):
    i = bisect.bisect_right(c, (t, float("inf"))) - 1
    return c[i][1] if i >= 0 else 0


def io_main(ev, first):
    spans = [e for e in ev if e.get("ph") == "X"]
    rd_iv, wr_iv = io_intervals(ev)
    rd_c, wr_c = counter(ev, "nvme bytes read"), counter(ev, "nvme bytes written")
    phases = (("forward", lambda n: n.startswith("block forward") or n == "embeddings forward"),
              ("backward", lambda n: n.startswith("block backward") or n.startswith("head")
               or n == "embeddings backward"),
              ("optimizer", lambda n: n == "optimizer"))
    print("# step  phase          ms   rd_MB   wr_MB  busy%  rd%  wr%  rd_inflight  wr_inflight")
    for st in spans:
        if not st["name"].startswith("step ") or int(st["name"].split()[1]) < first:
            continue
        a, b = st["ts"], st["ts"] + st["dur"]
        inn = [e for e in spans if a <= e["ts"] < b]
        wins = []
        for name, pred in phases:
            mine = [e for e in inn if pred(e["name"])]
            if mine:
                wins.append((name, min(e["ts"] for e in mine),
                             max(e["ts"] + e["dur"] for e in mine)))
        wins.append(("step", a, b))
        for name, x, y in wins:
            anyb, _ = busy(rd_iv + wr_iv, x, y)
            rb, rq = busy(rd_iv, x, y)
            wb, wq = busy(wr_iv, x, y)
            print("  %4s  %-9s %7.0f %7.0f %7.0f %6.0f %4.0f %4.0f %12.1f %12.1f" % (
                st["name"].split()[1], name, (y - x) / 1e3,
                (value_at(rd_c, y) - value_at(rd_c, x)) / 1e6,
                (value_at(wr_c, y) - value_at(wr_c, x)) / 1e6, anyb * 100, rb * 100, wb * 100,
                rq, wq))


def main():
    if sys.argv[1] == "--io":
        ev = json.load(open(sys.argv[2]))
        ev = ev["traceEvents"] if isinstance(ev, dict) else ev
        io_main(ev, int(sys.argv[3]) if len(sys.argv) > 3 else 2)
        return
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
