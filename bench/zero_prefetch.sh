#!/usr/bin/env bash
# zero_prefetch.sh - ZeRO stage 3 across ranks with the next block's gather behind this
# block's compute (stage3_prefetch_bucket_size, DeepSpeed's default) and without it (0),
# alternating, ROUNDS rounds: the mean step time of steps 2..S of each run.
#
# usage: bench/zero_prefetch.sh [SWAPDIR]   (default ./swap-prefetch)
#   ZINF=build/tools/zinf RANKS=2 ROUNDS=3 LAYERS=6 DIM=512 HEADS=8 SEQ=128 BATCH=4 STEPS=4
set -euo pipefail
swap=${1:-swap-prefetch}
zinf=${ZINF:-build/tools/zinf}
N=${RANKS:-2} R=${ROUNDS:-3}
L=${LAYERS:-6} C=${DIM:-512} H=${HEADS:-8} T=${SEQ:-128} B=${BATCH:-4} S=${STEPS:-4}
data=${DATA:-/usr/share/common-licenses/GPL-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$swap"' EXIT
for round in $(seq "$R"); do
  for bucket in 50000000 0; do
    rm -rf "$swap"
    cat > "$tmp/c.json" <<JSON
{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": $bucket,
 "offload_param": {"device": "nvme", "nvme_path": "$swap"},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$swap"}},
 "aio": {"block_size": 262144, "queue_depth": 16},
 "zinf": {"device": "emulated", "device_bytes": "96M", "host_bytes": "160M"}}
JSON
    "$zinf" launch -n "$N" -- "$zinf" train --config "$tmp/c.json" --data "$data" --layers "$L" \
      --dim "$C" --heads "$H" --seq "$T" --batch "$B" --steps "$S" --log "$tmp/r.jsonl" \
      >/dev/null 2>"$tmp/err" || { cat "$tmp/err"; exit 1; }
    python3 - "$tmp/r.jsonl" "$round" "$bucket" <<'PY'
import json, sys
ms = [j["ms"] for j in map(json.loads, open(sys.argv[1])) if j.get("step", 0) >= 2]
print("round %s bucket %s: %.0f ms" % (sys.argv[2], sys.argv[3], sum(ms) / len(ms)))
PY
  done
done
