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

    step_breakdown.py --io TRACE.json FIRST_STEP --floor READ_GBPS WRITE_GBPS MEM_TRACE.json

--floor: also each phase's IO time at those rates (`zinf bench`'s, same run: io_ms) and the
same phase's median time in the in-memory run's trace (mem_ms), and for each step its phase
floor: the sum over the phases of the larger of the two. The phases follow one another (the
backward needs the forward's loss, and an update the gradient norm, which needs the whole
backward), so IO that stays in its phase can overlap that phase's compute only: the step
cannot beat its phase floor unless IO moves to another phase, which takes memory to hold
what is read early or written late.
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


PHASES = (("forward", lambda n: n.startswith("block forward") or n == "embeddings forward"),
          ("backward", lambda n: n.startswith("block backward") or n.startswith("head")
           or n == "embeddings backward"),
          ("optimizer", lambda n: n == "optimizer"))


def phase_windows(ev, first):
    """[(step, [(phase, start, end), ..., ("step", start, end)])] for the steps >= first."""
    spans = [e for e in ev if e.get("ph") == "X"]
    out = []
    for st in spans:
        if not st["name"].startswith("step ") or int(st["name"].split()[1]) < first:
            continue
        a, b = st["ts"], st["ts"] + st["dur"]
        inn = [e for e in spans if a <= e["ts"] < b]
        wins = []
        for name, pred in PHASES:
            mine = [e for e in inn if pred(e["name"])]
            if mine:
                wins.append((name, min(e["ts"] for e in mine),
                             max(e["ts"] + e["dur"] for e in mine)))
        wins.append(("step", a, b))
        out.append((st["name"].split()[1], wins))
    return out


def io_main(ev, first, floor=None):
    """floor: (read GB/s, write GB/s, {phase: in-memory ms}) for the phase floor's columns."""
    rd_iv, wr_iv = io_intervals(ev)
    rd_c, wr_c = counter(ev, "nvme bytes read"), counter(ev, "nvme bytes written")
    print("# step  phase          ms   rd_MB   wr_MB  busy%  rd%  wr%  rd_inflight  wr_inflight"
          + ("    io_ms   mem_ms" if floor else ""))
    for step, wins in phase_windows(ev, first):
        phase_floor = 0.0
        for name, x, y in wins:
            anyb, _ = busy(rd_iv + wr_iv, x, y)
            rb, rq = busy(rd_iv, x, y)
            wb, wq = busy(wr_iv, x, y)
            rd = (value_at(rd_c, y) - value_at(rd_c, x)) / 1e6
            wr = (value_at(wr_c, y) - value_at(wr_c, x)) / 1e6
            extra = ""
            if floor:
                io_ms = rd / floor[0] + wr / floor[1]  # MB over GB/s: ms
                mem_ms = floor[2].get(name, 0.0)
                if name != "step":
                    phase_floor += max(io_ms, mem_ms)
                extra = " %8.0f %8.0f" % (io_ms, mem_ms)
            print("  %4s  %-9s %7.0f %7.0f %7.0f %6.0f %4.0f %4.0f %12.1f %12.1f%s" % (
                step, name, (y - x) / 1e3, rd, wr, anyb * 100, rb * 100, wb * 100, rq, wq,
                extra))
        if floor:
            ms = (wins[-1][2] - wins[-1][1]) / 1e3
            print("  %4s  phase floor %5.0f ms: the step is %.3fx it" % (
                step, phase_floor, ms / phase_floor))


def mem_phase_ms(ev, first):
    """The median time of each phase (and of the step) over the steps >= first, in ms."""
    by = {}
    for _, wins in phase_windows(ev, first):
        for name, x, y in wins:
            by.setdefault(name, []).append((y - x) / 1e3)
    return {k: sorted(v)[len(v) // 2] for k, v in by.items()}


def load(path):
    ev = json.load(open(path))
    return ev["traceEvents"] if isinstance(ev, dict) else ev


def main():
    if sys.argv[1] == "--io":
        first = int(sys.argv[3]) if len(sys.argv) > 3 else 2
        floor = None
        if len(sys.argv) > 4:
            if sys.argv[4] != "--floor" or len(sys.argv) != 8:
                sys.exit("usage: step_breakdown.py --io TRACE.json FIRST_STEP "
                         "--floor READ_GBPS WRITE_GBPS MEM_TRACE.json")
            floor = (float(sys.argv[5]), float(sys.argv[6]),
                     mem_phase_ms(load(sys.argv[7]), first))
        io_main(load(sys.argv[2]), first, floor)
        return
    ev = load(sys.argv[1])
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
