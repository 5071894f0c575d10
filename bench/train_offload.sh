#!/usr/bin/env bash
# train_offload.sh - step time of `zinf train` with everything offloaded to NVMe (budgets
# far below the model's state) against everything in device memory, same model, same
# data, alternating, in one run. The model is chosen so that compute dominates IO: each
# step does about 6 x params x tokens flops, and moves about 3 x 16 bytes per parameter.
#
# MODE=host compares instead weights streamed from host memory (offload_param "cpu", a
# device budget below the weights) with weights resident on the device; the optimizer
# runs on the host in both, so only where the weights live differs.
#
# usage: bench/train_offload.sh [SWAPDIR] [ROUNDS]   (defaults: ./swap-train 2)
#   ZINF=build/tools/zinf  LAYERS=4 DIM=256 HEADS=8 SEQ=128 BATCH=16 STEPS=6
#   DEVICE_BYTES / HOST_BYTES: the offloaded run's budgets (default 16M / 20M)
#   MODE=nvme|host (default nvme)  DEVICE=emulated|cuda (default emulated)
#   PRECISION=auto|fp32|bf16 (default auto: bf16 on a GPU)  TARGET: the ratio to meet
#   RES_DEVICE_BYTES / RES_HOST_BYTES: the resident run's budgets (default 4G / 1G)
set -euo pipefail

swap=${1:-swap-train}
rounds=${2:-2}
zinf=${ZINF:-build/tools/zinf}
L=${LAYERS:-4} C=${DIM:-256} H=${HEADS:-8} T=${SEQ:-128} B=${BATCH:-16} S=${STEPS:-6}
dev=${DEVICE_BYTES:-16M} host=${HOST_BYTES:-20M}
mode=${MODE:-nvme} device=${DEVICE:-emulated} precision=${PRECISION:-auto}
rdev=${RES_DEVICE_BYTES:-4G} rhost=${RES_HOST_BYTES:-1G}
if [ "$mode" = host ]; then target=${TARGET:-1.2}; else target=${TARGET:-1.15}; fi
data=${DATA:-/usr/share/common-licenses/GPL-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$swap"' EXIT
mkdir -p "$swap"

if [ "$mode" = host ]; then
cat > "$tmp/mem.json" <<JSON
{"zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
 "offload_optimizer": {"device": "cpu", "pin_memory": true}},
 "zinf": {"device": "$device", "device_bytes": "$rdev", "host_bytes": "$rhost"}}
JSON
cat > "$tmp/nvme.json" <<JSON
{"zero_optimization": {"stage": 3,
 "offload_param": {"device": "cpu", "pin_memory": true},
 "offload_optimizer": {"device": "cpu", "pin_memory": true}},
 "zinf": {"device": "$device", "device_bytes": "$dev", "host_bytes": "$host"}}
JSON
else
cat > "$tmp/mem.json" <<JSON
{"zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
 "offload_optimizer": {"device": "none"}},
 "zinf": {"device": "$device", "device_bytes": "$rdev", "host_bytes": "$rhost"}}
JSON
cat > "$tmp/nvme.json" <<JSON
{"zero_optimization": {"stage": 3,
 "offload_param": {"device": "nvme", "nvme_path": "$swap", "pin_memory": true},
 "offload_optimizer": {"device": "nvme", "nvme_path": "$swap", "pin_memory": true}},
 "aio": {"block_size": 262144, "queue_depth": 16},
 "zinf": {"device": "$device", "device_bytes": "$dev", "host_bytes": "$host"}}
JSON
fi

run() { # config log -> prints mean ms of steps 2..S
  if ! "$zinf" train --config "$1" --data "$data" --layers "$L" --dim "$C" --heads "$H" \
      --seq "$T" --batch "$B" --steps "$S" --precision "$precision" --log "$2" \
      > "$2.out" 2> "$2.err"; then
    echo "train_offload: zinf train failed ($1):" >&2
    grep -v 'runs unpinned' "$2.err" >&2
    return 1
  fi
  python3 - "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if 'step' in r]
summ = [r['summary'] for r in rows if 'summary' in r][0]
ms = [r['ms'] for r in steps[1:]]
print(sum(ms) / len(ms), ' '.join(repr(r['loss']) for r in steps), summ['model_state_bytes'],
      summ['device']['peak_bytes'], summ['device']['budget_bytes'], summ['host']['peak_bytes'],
      summ['host']['budget_bytes'])
PY
}

echo "# train_offload: layers $L dim $C heads $H seq $T batch $B, $S steps, $rounds rounds"
echo "# mode $mode (offloaded: $([ "$mode" = host ] && echo "weights in host memory" || echo "everything on NVMe")), device $device, precision $precision"
echo "# data $data; offloaded budgets device $dev host $host; resident $rdev / $rhost; swap $swap"
echo "# $(uname -sr), $(nproc) cpus"
printf "# %5s %12s %12s %8s %s\n" round resident_ms offload_ms ratio "losses equal"
ratios=()
for ((i = 1; i <= rounds; i++)); do
  out=$(run "$tmp/mem.json" "$tmp/mem.$i.jsonl") || exit 1
  read -r mms mloss_rest <<< "$out"
  out=$(run "$tmp/nvme.json" "$tmp/nvme.$i.jsonl") || exit 1
  read -r nms nloss_rest <<< "$out"
  mloss=$(python3 -c "import sys; print(' '.join(sys.argv[1].split()[:$S]))" "$mloss_rest")
  nloss=$(python3 -c "import sys; print(' '.join(sys.argv[1].split()[:$S]))" "$nloss_rest")
  ratio=$(python3 -c "print('%.3f' % ($nms / $mms))")
  ratios+=("$ratio")
  printf "  %5d %12.1f %12.1f %8s %s\n" "$i" "$mms" "$nms" "$ratio" \
    "$([ "$mloss" = "$nloss" ] && echo yes || echo NO)"
  rm -rf "$swap"/*
done
read -r _ _ state dpeak dbud hpeak hbud < <(echo "$nloss_rest" | awk -v S="$S" '{printf "x x"; for (i = S + 1; i <= NF; i++) printf " %s", $i; print ""}')
echo "# model state $state B; offloaded run: device peak $dpeak of $dbud B, host peak $hpeak of $hbud B"
python3 - "$target" "${ratios[@]}" <<'PY'
import sys
t = float(sys.argv[1])
r = sorted(float(x) for x in sys.argv[2:])
med = r[len(r) // 2] if len(r) % 2 else (r[len(r) // 2 - 1] + r[len(r) // 2]) / 2
print("# median step-time ratio offloaded / resident: %.3f (target <= %g: %s)" % (med, t, "met" if med <= t else "NOT met"))
PY
