#!/usr/bin/env bash
# budget_grid.sh - does every budget either run or get refused before step 1? `zinf train`
# over a grid of device x host budgets for a few model shapes, everything offloaded to NVMe,
# a few steps each. Each point ends one of three ways: "ran" (every step), "refused" (exit
# 2 at open, naming the smallest budgets that run, which are printed), or "FAILED" (it was
# taken and then failed: what this grid exists to catch; the script exits 1 then).
#
# usage: bench/budget_grid.sh DIR [STEPS]   (default 3)
#   ZINF=build/tools/zinf  SHAPES="6x128 3x192" (layers x dim; heads 4)
#   DEVICE="1536K 2M 2560K 3M 4M"  HOST="2M 4M 6M 8M"  PRECISION=fp32|bf16  SEQ=64 BATCH=4
set -euo pipefail

dir=${1:?usage: bench/budget_grid.sh DIR [STEPS]}
steps=${2:-3}
zinf=${ZINF:-build/tools/zinf}
shapes=${SHAPES:-"6x128 3x192"}
devs=${DEVICE:-"1536K 2M 2560K 3M 4M"}
hosts=${HOST:-"2M 4M 6M 8M"}
prec=${PRECISION:-fp32}
T=${SEQ:-64} B=${BATCH:-4}
data=${DATA:-/usr/share/common-licenses/GPL-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$dir/grid-swap"' EXIT

failed=0
printf '# %-7s %-6s %-6s %-8s %s\n' shape device host result "least budgets that run"
for shape in $shapes; do
  L=${shape%x*} C=${shape#*x}
  for d in $devs; do
    for h in $hosts; do
      rm -rf "$dir/grid-swap"
      cat > "$tmp/c.json" <<JSON
{"zero_optimization": {"stage": 3,
  "offload_param": {"device": "nvme", "nvme_path": "$dir/grid-swap"},
  "offload_optimizer": {"device": "nvme", "nvme_path": "$dir/grid-swap"}},
 "aio": {"block_size": 262144, "queue_depth": 16},
 "zinf": {"device_bytes": "$d", "host_bytes": "$h"}}
JSON
      rc=0
      "$zinf" train --config "$tmp/c.json" --data "$data" --layers "$L" --dim "$C" --heads 4 \
        --seq "$T" --batch "$B" --steps "$steps" --precision "$prec" --log "$tmp/l.jsonl" \
        >"$tmp/out" 2>&1 || rc=$?
      least=$(grep -o '"device_bytes": [0-9]*, "host_bytes": [0-9]*' "$tmp/out" | head -n 1 |
              sed 's/"device_bytes": \([0-9]*\), "host_bytes": \([0-9]*\)/device \1, host \2/' || true)
      if [ "$rc" = 0 ] && grep -q "^# summary: $steps steps" "$tmp/out"; then
        result=ran
        least=$(grep -o '"min_device_bytes":[0-9]*,"min_host_bytes":[0-9]*' "$tmp/l.jsonl" |
                tail -n 1 | sed 's/"min_device_bytes":\([0-9]*\),"min_host_bytes":\([0-9]*\)/device \1, host \2/' || true)
      elif [ "$rc" = 2 ] && [ -n "$least" ]; then
        result=refused
      else
        result=FAILED
        failed=1
        least="exit $rc: $(grep -m1 'failed' "$tmp/out" || tail -n 1 "$tmp/out" || true)"
      fi
      printf '  %-7s %-6s %-6s %-8s %s\n' "$shape" "$d" "$h" "$result" "$least"
    done
  done
done
exit $failed
