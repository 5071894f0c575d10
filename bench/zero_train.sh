#!/usr/bin/env bash
# zero_train.sh - `zinf train` across ranks (ZeRO stages 1-3, the shm backend) against one
# rank accumulating the same micro-batches, same model and data, everything on NVMe, in one
# run. For each stage it prints the mean step time of steps 2..S and, per rank, the
# smallest device and host budgets that run it and the swap files' peak (--log summaries), and checks that the losses agree
# bitwise (N ranks of one micro-batch = one rank of N). The launcher gives each rank
# CPUs / N OpenMP threads; OpenBLAS's sums depend on the thread count, so the bitwise
# reference is one rank with as many threads as a rank has, and the timing reference one
# rank with every CPU.
#
# usage: bench/zero_train.sh [SWAPDIR]   (default ./swap-zero)
#   ZINF=build/tools/zinf RANKS=2 LAYERS=6 DIM=512 HEADS=8 SEQ=128 BATCH=4 STEPS=4
#   DEVICE_BYTES / HOST_BYTES: each rank's budgets (default 96M / 160M)
set -euo pipefail

swap=${1:-swap-zero}
zinf=${ZINF:-build/tools/zinf}
N=${RANKS:-2} L=${LAYERS:-6} C=${DIM:-512} H=${HEADS:-8} T=${SEQ:-128} B=${BATCH:-4} S=${STEPS:-4}
dev=${DEVICE_BYTES:-96M} host=${HOST_BYTES:-160M}
data=${DATA:-/usr/share/common-licenses/GPL-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$swap"' EXIT

config() { # stage dir [extra zero_optimization keys] -> config path
  cat > "$tmp/s$1.json" <<JSON
{"zero_optimization": {"stage": $1, ${3:-}
 "offload_param": {"device": "nvme", "nvme_path": "$swap/$2"},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$swap/$2"}},
 "aio": {"block_size": 262144, "queue_depth": 16},
 "zinf": {"device": "emulated", "device_bytes": "$dev", "host_bytes": "$host"}}
JSON
  echo "$tmp/s$1.json"
}

summary() { # log -> "ms device host nvme": the smallest budgets that run, the swap files' peak
  python3 - "$1" "$S" <<'PY'
import json, sys
steps, peak = [], None
for line in open(sys.argv[1]):
    j = json.loads(line)
    if "step" in j and j["step"] >= 2: steps.append(j["ms"])
    if "summary" in j:
        s = j["summary"]
        peak = (s["min_device_bytes"], s["min_host_bytes"], s["nvme"]["peak_bytes"])
print("%.0f %d %d %d" % (sum(steps) / len(steps), *peak))
PY
}

losses() { grep -o '"loss":[^,]*' "$1" | tr '\n' ' '; }

args="--data $data --layers $L --dim $C --heads $H --seq $T --batch $B --steps $S"
echo "# zinf train across $N ranks against one rank accumulating $N micro-batches"
echo "# model: --layers $L --dim $C --heads $H --seq $T --batch $B, $S steps; budgets per rank: device $dev, host $host; everything on NVMe under $swap"
printf "# %-22s %10s %12s %12s %12s %s\n" "run (accumulating $N)" "step ms" "min device" "min host" "nvme peak" "losses"
rm -rf "$swap"
cpus=$(nproc)
per=$(( cpus / N > 0 ? cpus / N : 1 ))
cfg=$(config 3 one)
"$zinf" train --config "$cfg" $args --accumulate "$N" --log "$tmp/all.jsonl" >/dev/null 2>"$tmp/err" || { cat "$tmp/err"; exit 1; }
read -r ms d h n < <(summary "$tmp/all.jsonl")
printf "  %-22s %10s %12s %12s %12s %s\n" "1 rank, $cpus threads" "$ms" "$d" "$h" "$n" "-"
cfg=$(config 3 one1)
OMP_NUM_THREADS=$per "$zinf" train --config "$cfg" $args --accumulate "$N" --log "$tmp/one.jsonl" >/dev/null 2>"$tmp/err" || { cat "$tmp/err"; exit 1; }
read -r ms d h n < <(summary "$tmp/one.jsonl")
printf "  %-22s %10s %12s %12s %12s %s\n" "1 rank, $per thread(s)" "$ms" "$d" "$h" "$n" "reference"
one=$(losses "$tmp/one.jsonl")
for stage in 1 2 3 3n; do
  # 3n: stage 3 gathering no block ahead (stage3_prefetch_bucket_size 0)
  extra=; label="$N ranks, stage $stage"
  [ "$stage" = 3n ] && extra='"stage3_prefetch_bucket_size": 0,' && label="$N ranks, 3, no gather ahead"
  cfg=$(config "${stage%n}" "r$stage" "$extra")
  "$zinf" launch -n "$N" -- "$zinf" train --config "$cfg" $args --log "$tmp/r$stage.jsonl" >/dev/null 2>"$tmp/err" || { cat "$tmp/err"; exit 1; }
  read -r ms d h n < <(summary "$tmp/r$stage.jsonl")
  same=$([ "$(losses "$tmp/r$stage.jsonl")" = "$one" ] && echo "bitwise equal" || echo "DIFFER")
  printf "  %-22s %10s %12s %12s %12s %s\n" "$label" "$ms" "$d" "$h" "$n" "$same"
done
