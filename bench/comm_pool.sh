#!/usr/bin/env bash
# comm_pool.sh - the ranks' collectives on the one-copy path (zinf.comm_pool) against the
# staging path, side by side in one run:
#   1. bench/comm at 64 MiB and above, buffers from the pool (--pool, out of place and
#      --in-place) and private, next to
#      one thread's memcpy (the footer's, same run): busbw over memcpy;
#   2. the trainer's own step across RANKS ranks at stages 1-3, comm_pool true and false,
#      rounds alternating: the median step and the time the steps waited for gradient
#      reductions (the summary's reduce_seconds), the share of collectives that took the
#      pooled path, and whether the losses agree bitwise.
#
# usage: bench/comm_pool.sh DIR [ROUNDS]   (default 2)
#   ZINF=build/tools/zinf COMM=build/bench/comm RANKS=2 LAYERS=6 DIM=512 HEADS=8 SEQ=128
#   BATCH=4 STEPS=5 DEVICE_BYTES=256M HOST_BYTES=256M
set -euo pipefail

dir=${1:?usage: bench/comm_pool.sh DIR [ROUNDS]}
rounds=${2:-2}
zinf=${ZINF:-build/tools/zinf}
comm=${COMM:-build/bench/comm}
N=${RANKS:-2} L=${LAYERS:-6} C=${DIM:-512} H=${HEADS:-8} T=${SEQ:-128} B=${BATCH:-4} S=${STEPS:-5}
dev=${DEVICE_BYTES:-256M} host=${HOST_BYTES:-256M}
data=${DATA:-/usr/share/common-licenses/GPL-3}
tmp=$(mktemp -d)
swap=$dir/comm-pool-swap
trap 'rm -rf "$tmp" "$swap"' EXIT

echo "# comm_pool: $N ranks, $(nproc) cpus: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "## 1. bench/comm, 64M..256M, pooled (one copy; out of place and in place) and private (staging)"
for mode in pool pool-in-place private; do
  flag=()
  [ "$mode" = pool ] && flag=(--pool)
  [ "$mode" = pool-in-place ] && flag=(--pool --in-place)
  "$comm" --ranks "$N" --min 64M --max 256M --iters 5 "${flag[@]}" > "$tmp/comm.$mode"
  echo "# $mode:"
  grep -v '^#  ' "$tmp/comm.$mode" | grep -v '^# zinf' | sed 's/^/  /'
done

echo "## 2. zinf train, $N ranks, ${L}x$C, batch $B x $T, $S steps (medians of 2..$S), device $dev, host $host per rank"
for stage in 1 2 3; do
  for pool in true false; do
    cat > "$tmp/s$stage.$pool.json" <<JSON
{"zero_optimization": {"stage": $stage, "offload_param": {"device": "nvme"},
 "offload_optimizer": {"device": "nvme"}},
 "aio": {"block_size": 1048576, "queue_depth": 16},
 "zinf": {"device": "emulated", "nvme_paths": ["$swap"], "device_bytes": "$dev",
          "host_bytes": "$host", "comm_pool": $pool}}
JSON
  done
done
for ((r = 1; r <= rounds; r++)); do
  for stage in 1 2 3; do
    for pool in true false; do
      rm -rf "$swap"
      "$zinf" launch -n "$N" -- "$zinf" train --config "$tmp/s$stage.$pool.json" --data "$data" \
        --layers "$L" --dim "$C" --heads "$H" --seq "$T" --batch "$B" --steps "$S" \
        --precision fp32 --log "$tmp/s$stage.$pool.$r.jsonl" > "$tmp/out" 2>&1 ||
        { tail -5 "$tmp/out"; exit 1; }
    done
  done
done
python3 - "$tmp" "$rounds" <<'PY'
import json, statistics as st, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
print("# %5s %9s %10s %12s %14s %s" % ("stage", "comm_pool", "step ms", "reduce s", "pooled/ops", "losses"))
for stage in (1, 2, 3):
    res = {}
    for pool in ("true", "false"):
        ms, red, pooled, ops, losses = [], [], 0, 0, set()
        for r in range(1, rounds + 1):
            rows = [json.loads(l) for l in open(f"{tmp}/s{stage}.{pool}.{r}.jsonl")]
            steps = [x for x in rows if "step" in x]
            ms.append(st.median(x["ms"] for x in steps[1:]))
            s = [x["summary"] for x in rows if "summary" in x][0]
            red.append(s["reduce_seconds"])
            pooled, ops = s["comm_pooled_ops"], s["comm_ops"]
            losses.add(tuple(x["loss"] for x in steps))
        res[pool] = (st.median(ms), st.median(red), losses)
        print("  %5d %9s %10.0f %12.3f %8d/%-5d %s" % (stage, pool, st.median(ms), st.median(red),
              pooled, ops, "same every round" if len(losses) == 1 else "DIFFER between rounds"))
    on, off = res["true"], res["false"]
    print("  stage %d: step with the pool / without: %.3f; reduce wait: %.3f; losses %s" % (
          stage, on[0] / off[0], on[1] / off[1] if off[1] else float("nan"),
          "bitwise equal" if on[2] == off[2] else "DIFFER"))
PY
