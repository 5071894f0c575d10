#!/usr/bin/env bash
# act_offload.sh - the step with its activation checkpoints on NVMe against its bounds, side by
# side in one run: the same model trained with everything in memory ("mem"), and with the
# checkpoints homed on NVMe ("act": zinf.train.activation_offload "auto" with a host budget
# below them and the smallest device budget that runs, so that the device holds two of them
# at once and the others are written back and read again), rounds alternating, next to
# `zinf bench` on the same directory.
#
# For each run: the median step time of steps 2..S and the NVMe bytes a step moves. Then
#   in memory  the same step with the checkpoints in memory
#   IO floor   the step's NVMe bytes over zinf bench's read and write rates (same run)
# and the ratio of the offloaded step to the larger (the target: <= 1.15). Losses and
# digests must be equal, bit for bit.
#
# usage: bench/act_offload.sh DIR [ROUNDS]     (default 2)
#   ZINF=build/tools/zinf  LAYERS=6 DIM=256 HEADS=4 SEQ=512 BATCH=8 STEPS=4
#   HOST_BYTES=1M (the offloaded run's host budget)  BLOCK=1M QD=32  DEVICE=emulated
set -euo pipefail

dir=${1:?usage: bench/act_offload.sh DIR [ROUNDS]}
rounds=${2:-2}
zinf=${ZINF:-build/tools/zinf}
L=${LAYERS:-6} C=${DIM:-256} H=${HEADS:-4} T=${SEQ:-512} B=${BATCH:-8} S=${STEPS:-4}
host=${HOST_BYTES:-1M} block=${BLOCK:-1M} qd=${QD:-32} device=${DEVICE:-emulated}
data=${DATA:-/usr/share/common-licenses/GPL-3}
swap=$dir/act-offload-swap
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$swap"' EXIT
mkdir -p "$swap"
args=(--data "$data" --layers "$L" --dim "$C" --heads "$H" --seq "$T" --batch "$B"
      --steps "$S" --precision fp32 --overwrite)

conf() { # name device_bytes host_bytes -> $tmp/name.json
  cat > "$tmp/$1.json" <<JSON
{"zero_optimization": {"stage": 0},
 "aio": {"block_size": $(numfmt --from=iec "$block"), "queue_depth": $qd},
 "zinf": {"device": "$device", "device_bytes": "$2", "host_bytes": "$3",
          "nvme_paths": "$swap", "train": {"checkpoint_every": 0}}}
JSON
}
conf mem 8G 1G
# The smallest device budget with the checkpoints on NVMe: the one the refusal names.
conf probe 64K "$host"
need=$({ "$zinf" train --config "$tmp/probe.json" "${args[@]}" --dry-run 2>&1 || true; } |
       sed -n 's/.*"device_bytes": \([0-9]*\).*/\1/p' | head -1)
[ -n "$need" ] || { echo "act_offload: no smallest device budget in the refusal" >&2; exit 1; }
conf act "$need" "$host"

raw=$("$zinf" bench --path "$dir" --size 1G --block-size "$block" --queue-depth "$qd" --json)
read -r brd bwr < <(printf '%s\n' "$raw" | python3 -c 'import json,sys
rows={r["op"]: r for r in map(json.loads, sys.stdin)}
assert all(r["verified"] for r in rows.values())
print(rows["read"]["GBps"], rows["write"]["GBps"])')

run() { # name round
  local log=$tmp/$1.$2.jsonl
  rm -rf "${swap:?}"/*
  if ! "$zinf" train --config "$tmp/$1.json" "${args[@]}" --log "$log" > "$log.out" \
      2> "$log.err"; then
    echo "act_offload: zinf train failed ($1):" >&2
    cat "$log.err" >&2
    exit 1
  fi
}

act=$((B * T * C * 4))
echo "# act_offload: $L x $C, $H heads, batch $B x $T, fp32, $S steps (medians of 2..$S), $rounds rounds"
echo "# checkpoints: $((L + 1)) x $(numfmt --to=iec $act) = $(numfmt --to=iec $(((L + 1) * act))); offloaded run: device ($device) $need bytes, host $host"
echo "# zinf bench on DIR, 1 GiB, block $block, qd $qd: read $brd GB/s, write $bwr GB/s"
echo "# $(uname -sr), $(nproc) cpus: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
for ((i = 1; i <= rounds; i++)); do
  for name in mem act; do run "$name" "$i"; done
done

python3 - "$tmp" "$rounds" "$brd" "$bwr" <<'PY'
import json, statistics as st, sys
tmp, rounds, brd, bwr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])

def load(name, i):
    rows = [json.loads(l) for l in open("%s/%s.%d.jsonl" % (tmp, name, i))]
    steps = [r for r in rows if "step" in r]
    later = steps[1:]
    return dict(ms=st.median(r["ms"] for r in later),
                rd=st.median(r["nvme_read_GBps"] * r["ms"] / 1e3 for r in later),
                wr=st.median(r["nvme_write_GBps"] * r["ms"] / 1e3 for r in later),
                blocked=st.median(r["blocked"] for r in later),
                losses=[r["loss"] for r in steps], digests=[r["digest"] for r in steps])

print("# %5s %-4s %9s %8s %8s %8s" % ("round", "run", "step_ms", "rd_GB", "wr_GB", "blocked"))
res = {"mem": [], "act": []}
for i in range(1, rounds + 1):
    for n in res:
        r = load(n, i)
        res[n].append(r)
        print("  %5d %-4s %9.1f %8.4f %8.4f %7.1f%%" % (i, n, r["ms"], r["rd"], r["wr"],
                                                    r["blocked"] * 100))
same = all(r["losses"] == res["mem"][0]["losses"] and r["digests"] == res["mem"][0]["digests"]
           for n in res for r in res[n])
med = lambda n, k: st.median(r[k] for r in res[n])
mem, act = med("mem", "ms"), med("act", "ms")
io = (med("act", "rd") / brd + med("act", "wr") / bwr) * 1e3
bound = max(mem, io)
print("# medians: in memory %.1f ms; checkpoints on NVMe %.1f ms (%.4f GB read, %.4f written "
      "a step); IO floor %.1f ms" % (mem, act, med("act", "rd"), med("act", "wr"), io))
print("# offloaded / max(in memory, IO floor) = %.1f / %.1f (%s): %.3f (target <= 1.15: %s)" % (
    act, bound, "in memory" if bound == mem else "IO floor", act / bound,
    "met" if act / bound <= 1.15 else "NOT met"))
print("# losses and digests equal in all runs: %s" % ("yes" if same else "NO"))
PY
