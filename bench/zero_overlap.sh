#!/usr/bin/env bash
# zero_overlap.sh - gradients across ranks reduced behind the next block's backward
# (overlap_comm true) and after each block's (false), alternating, ROUNDS rounds per
# stage: the mean step time of steps 2..S of each run, and the time rank 0's steps waited
# for gradient reductions (the summary's reduce_seconds, over all S steps).
#
# usage: bench/zero_overlap.sh [SWAPDIR]   (default ./swap-overlap)
#   ZINF=build/tools/zinf RANKS=2 ROUNDS=3 STAGES="2 3" LAYERS=6 DIM=512 HEADS=8 SEQ=128
#   BATCH=4 STEPS=4
set -euo pipefail
swap=${1:-swap-overlap}
zinf=${ZINF:-build/tools/zinf}
N=${RANKS:-2} R=${ROUNDS:-3} stages=${STAGES:-2 3}
L=${LAYERS:-6} C=${DIM:-512} H=${HEADS:-8} T=${SEQ:-128} B=${BATCH:-4} S=${STEPS:-4}
data=${DATA:-/usr/share/common-licenses/GPL-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$swap"' EXIT
for stage in $stages; do
  for round in $(seq "$R"); do
    for overlap in true false; do
      rm -rf "$swap"
      cat > "$tmp/c.json" <<JSON
{"zero_optimization": {"stage": $stage, "overlap_comm": $overlap,
 "offload_param": {"device": "nvme", "nvme_path": "$swap"},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$swap"}},
 "aio": {"block_size": 262144, "queue_depth": 16},
 "zinf": {"device": "emulated", "device_bytes": "128M", "host_bytes": "160M"}}
JSON
      "$zinf" launch -n "$N" -- "$zinf" train --config "$tmp/c.json" --data "$data" \
        --layers "$L" --dim "$C" --heads "$H" --seq "$T" --batch "$B" --steps "$S" \
        --log "$tmp/r.jsonl" >/dev/null 2>"$tmp/err" || { cat "$tmp/err"; exit 1; }
      python3 - "$tmp/r.jsonl" "$stage" "$round" "$overlap" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = [j["ms"] for j in rows if j.get("step", 0) >= 2]
s = [j["summary"] for j in rows if "summary" in j][0]
assert s["overlap_comm"] == (sys.argv[4] == "true"), s
print("stage %s round %s overlap_comm %-5s: %5.0f ms/step, waited %.3f s for reductions, "
      "min device %.1f MiB" % (sys.argv[2], sys.argv[3], sys.argv[4], sum(ms) / len(ms),
                               s["reduce_seconds"], s["min_device_bytes"] / 2**20))
PY
    done
  done
done
