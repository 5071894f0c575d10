#!/usr/bin/env bash
# offload_step.sh - the offloaded step against its bounds, side by side in one run: the same
# model trained in memory; offloaded to NVMe with each step's update deferred to the next
# forward (zinf.train.update_in_forward true, "fwd": the default on the CPU); offloaded with
# the optimizer's pipeline and the update at the end of the step (update_in_forward false,
# "on"); and without the pipeline (offload_optimizer.pipeline_read and pipeline_write false,
# "off"); rounds alternating, next to `zinf bench` on the same directory. The target is held
# against the default: "fwd" on the CPU, "on" on a GPU (where "fwd" is "on" again).
#
# For each run: the median step time of steps 2..S, the NVMe bytes a step moves, and the CPU
# seconds a step takes, in all and by thread (zinf train --log: cpu_by_thread). Then the
# bounds the offloaded step is held to:
#   in memory  the same step with nothing offloaded
#   IO floor   the step's NVMe bytes over zinf bench's read and write rates (same run)
#   CPU floor  the offloaded step's CPU seconds over the cores: with an emulated device its
#              copies and the IO completions are CPU work, which a GPU's copy engines and
#              DMA would take off the cores
# and the ratio of the offloaded step to the largest of them (the issue's target: <= 1.15).
# Losses and parameter digests must be equal, bit for bit, in all four.
#
# usage: bench/offload_step.sh DIR [ROUNDS]     (default 2)
#   ZINF=build/tools/zinf  LAYERS=12 DIM=768 HEADS=12 SEQ=64 BATCH=4 STEPS=6
#   DEVICE_BYTES=128M HOST_BYTES=256M (the offloaded runs' budgets)  BLOCK=1M QD=32
#   DEVICE=emulated (or cuda: the step on a GPU, whose copy engines move the device tier's
#   bytes; the update in the forward applies to CPU steps only, so there "fwd" is "on" again)
#   RUNS="mem on fwd off" (which runs, in this order; mem and the default's run are needed;
#   memh: in memory
#   with the optimizer on the host, whose bits a GPU's offloaded runs equal; a figure of a
#   run not made prints as nan)
#   TRACE=1: also write DIR/trace-<run>-<round>.json (zinf train --trace) for
#   bench/step_breakdown.py, and print the default run's phase floor in each round (its
#   phases' IO at zinf bench's rates against the in-memory run's phases: step_breakdown.py
#   --io --floor)
set -euo pipefail

dir=${1:?usage: bench/offload_step.sh DIR [ROUNDS]}
rounds=${2:-2}
zinf=${ZINF:-build/tools/zinf}
L=${LAYERS:-12} C=${DIM:-768} H=${HEADS:-12} T=${SEQ:-64} B=${BATCH:-4} S=${STEPS:-6}
dev=${DEVICE_BYTES:-128M} host=${HOST_BYTES:-256M}
block=${BLOCK:-1M} qd=${QD:-32}
device=${DEVICE:-emulated}
runs=${RUNS:-mem on fwd off}
data=${DATA:-/usr/share/common-licenses/GPL-3}
swap=$dir/offload-step-swap
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$swap"' EXIT
mkdir -p "$swap"

cat > "$tmp/mem.json" <<JSON
{"zero_optimization": {"offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}},
 "zinf": {"device": "$device", "device_bytes": "8G", "host_bytes": "1G"}}
JSON
# In memory with the optimizer's state and update on the host: on a GPU, the bits the offloaded
# runs must equal (their update runs on the CPU, "mem"'s on the GPU).
cat > "$tmp/memh.json" <<JSON
{"zero_optimization": {"offload_param": {"device": "none"}, "offload_optimizer": {"device": "cpu"}},
 "zinf": {"device": "$device", "device_bytes": "8G", "host_bytes": "2G"}}
JSON
for pipe in fwd on off; do
  extra="" train=false
  [ "$pipe" = off ] && extra=', "pipeline_read": false, "pipeline_write": false'
  [ "$pipe" = fwd ] && train=true
  cat > "$tmp/$pipe.json" <<JSON
{"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "$swap"},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$swap"$extra}},
 "aio": {"block_size": $(numfmt --from=iec "$block"), "queue_depth": $qd},
 "zinf": {"device": "$device", "device_bytes": "$dev", "host_bytes": "$host",
          "train": {"update_in_forward": $train}}}
JSON
done

raw=$("$zinf" bench --path "$dir" --size 2G --block-size "$block" --queue-depth "$qd" --json)
read -r brd bwr < <(printf '%s\n' "$raw" | python3 -c 'import json,sys
rows={r["op"]: r for r in map(json.loads, sys.stdin)}
assert all(r["verified"] for r in rows.values())
print(rows["read"]["GBps"], rows["write"]["GBps"])')

run() { # name round -> the log's path (the run's log is kept in $tmp)
  local log=$tmp/$1.$2.jsonl trace=()
  [ -n "${TRACE:-}" ] && trace=(--trace "$dir/trace-$1-$2.json")
  rm -rf "${swap:?}"/*
  if ! "$zinf" train --config "$tmp/$1.json" --data "$data" --layers "$L" --dim "$C" \
      --heads "$H" --seq "$T" --batch "$B" --steps "$S" --precision fp32 --overwrite \
      --log "$log" "${trace[@]}" > "$log.out" 2> "$log.err"; then
    echo "offload_step: zinf train failed ($1):" >&2
    grep -v 'runs unpinned' "$log.err" >&2
    exit 1
  fi
}

echo "# offload_step: $L x $C, $H heads, batch $B x $T, fp32, $S steps (medians of 2..$S), $rounds rounds"
echo "# offloaded: parameters and optimizer states on NVMe, device ($device) $dev, host $host"
echo "# zinf bench on DIR, 2 GiB, block $block, qd $qd: read $brd GB/s, write $bwr GB/s"
echo "# $(uname -sr), $(nproc) cpus: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
for ((i = 1; i <= rounds; i++)); do
  for name in $runs; do run "$name" "$i"; done
done

python3 - "$tmp" "$rounds" "$brd" "$bwr" "$(nproc)" "$runs" "$device" <<'PY'
import json, statistics as st, sys
tmp, rounds, brd, bwr, cores = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
runs = sys.argv[6].split()
dflt = "on" if sys.argv[7] == "cuda" else "fwd"  # the run zinf train's defaults make

def load(name, i):
    rows = [json.loads(l) for l in open("%s/%s.%d.jsonl" % (tmp, name, i))]
    steps = [r for r in rows if "step" in r]
    later = steps[1:]
    ms = st.median(r["ms"] for r in later)
    rd = st.median(r["nvme_read_GBps"] * r["ms"] / 1e3 for r in later)
    wr = st.median(r["nvme_write_GBps"] * r["ms"] / 1e3 for r in later)
    cpu = st.median(r["cpu_user_s"] + r["cpu_sys_s"] for r in later)
    names = sorted({k for r in later for k in r["cpu_by_thread"]})
    by = {k: st.median(r["cpu_by_thread"].get(k, 0) for r in later) for k in names}
    blocked = st.median(r["blocked"] for r in later)
    return dict(ms=ms, rd=rd, wr=wr, cpu=cpu, by=by, blocked=blocked,
                losses=[r["loss"] for r in steps], digests=[r["digest"] for r in steps])

print("# %5s %-4s %9s %8s %8s %8s %8s  %s" % ("round", "run", "step_ms", "rd_GB", "wr_GB", "cpu_s",
                                            "blocked", "cpu_s by thread"))
res = {n: [] for n in runs}
for i in range(1, rounds + 1):
    for n in runs:
        r = load(n, i)
        res[n].append(r)
        print("  %5d %-4s %9.1f %8.3f %8.3f %8.3f %7.1f%%  %s" % (
            i, n, r["ms"], r["rd"], r["wr"], r["cpu"], r["blocked"] * 100,
            " ".join("%s %.2f" % kv for kv in sorted(r["by"].items(), key=lambda kv: -kv[1]))))
same = all(r["losses"] == res["mem"][0]["losses"] and r["digests"] == res["mem"][0]["digests"]
           for n in res for r in res[n])
med = lambda n, k: st.median(r[k] for r in res[n]) if n in res else float("nan")
mem, on, fwd, off = med("mem", "ms"), med("on", "ms"), med("fwd", "ms"), med("off", "ms")
io = (med(dflt, "rd") / brd + med(dflt, "wr") / bwr) * 1e3
io_off = (med("off", "rd") / brd + med("off", "wr") / bwr) * 1e3
cpu = med(dflt, "cpu") / cores * 1e3
bound = max(mem, io, cpu)
which = {mem: "in memory", io: "IO floor", cpu: "CPU floor"}[bound]
step = med(dflt, "ms")
print("# medians over the rounds: in memory %.1f ms; offloaded %.1f ms (the update at the "
      "step's end), %.1f (the update in the next forward), %.1f (no pipeline); the default: "
      "%s" % (mem, on, fwd, off, dflt))
print("# IO floor %.1f ms (%.3f GB read, %.3f written a step by %s; without the pipeline %.1f "
      "ms); CPU floor %.1f ms (%.3f CPU-s a step over %d cores; in memory %.3f CPU-s)" % (
          io, med(dflt, "rd"), med(dflt, "wr"), dflt, io_off, cpu, med(dflt, "cpu"), cores,
          med("mem", "cpu")))
print("# offloaded / in memory: %.3f (the update at the step's end), %.3f (update in the "
      "forward), %.3f (no pipeline); update in the forward / at the step's end: %.3f; the "
      "pipeline's step / the one without: %.3f" % (on / mem, fwd / mem, off / mem, fwd / on,
                                                   on / off))
print("# the default (%s) / max(in memory, IO floor, CPU floor) = %.1f / %.1f (%s): %.3f "
      "(target <= 1.15: %s)" % (dflt, step, bound, which, step / bound,
                                "met" if step / bound <= 1.15 else "NOT met"))
print("# losses and digests equal in all runs: %s" % ("yes" if same else "NO"))
if not same:  # which runs agree: each group is one set of bits
    groups = {}
    for n in res:
        for i, r in enumerate(res[n], 1):
            bits = (tuple(r["losses"]), tuple(r["digests"]))
            groups.setdefault(bits, []).append("%s.%d" % (n, i))
    for (losses, digests), names in groups.items():
        print("#   %s: losses %s; last digest %s" % (" ".join(names), " ".join(map(str, losses)),
                                                    digests[-1] if digests else None))
PY
if [ -n "${TRACE:-}" ] && [[ " $runs " == *" mem "* ]]; then
  dflt=fwd; [ "$device" = cuda ] && dflt=on
  if [[ " $runs " == *" $dflt "* ]]; then
    for ((i = 1; i <= rounds; i++)); do
      echo "## round $i: the default ($dflt) by phase, against the in-memory run's phases"
      python3 "$(dirname "$0")/step_breakdown.py" --io "$dir/trace-$dflt-$i.json" 2 \
        --floor "$brd" "$bwr" "$dir/trace-mem-$i.json"
    done
  fi
fi
