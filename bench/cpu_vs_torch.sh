#!/usr/bin/env bash
# cpu_vs_torch.sh - the in-memory step of `zinf train` on the CPU against PyTorch eager on
# the CPU, same model (bench/torch_gpt_bench.py builds zinf's GPT in torch), same batch,
# same threads, activation checkpointing in both, alternating, ROUNDS rounds per shape.
# zinf runs with everything homed on the emulated device tier (offload_* "none"), fp32.
# Reported per shape: the median of each round's mean step (steps 2..STEPS), the ratio
# zinf / torch, and zinf's CPU time in the kernel as a share of its steps' CPU time (from
# the cpu_user_s / cpu_sys_s of its --log).
#
# Then the same math, checked: zinf exports its initial weights (--steps 0 --export), PyTorch
# starts from them and reads the batches zinf draws, and each step's loss of the two is
# compared (CHECK_STEPS steps per shape; CHECK=0 skips this).
#
# Sets up what it needs when missing: a venv with torch from PyPI (VENV, about 5 GB, once).
#
# usage: bench/cpu_vs_torch.sh [ROUNDS]   (default 3)
#   SHAPES="12x768x12 4x256x4" (layers x dim x heads)  SEQ=64 BATCH=4  STEPS=5 (12 for a
#   model under 10 M parameters)  THREADS=$(nproc)  ZINF=build/tools/zinf
#   VENV=/var/tmp/zinf-torch-venv  DATA=/usr/share/common-licenses/GPL-3  TARGET=1.2
set -euo pipefail

rounds=${1:-3}
zinf=${ZINF:-build/tools/zinf}
shapes=${SHAPES:-12x768x12 4x256x4}
T=${SEQ:-64} B=${BATCH:-4} threads=${THREADS:-$(nproc)}
data=${DATA:-/usr/share/common-licenses/GPL-3}
target=${TARGET:-1.2}
venv=${VENV:-/var/tmp/zinf-torch-venv}
here=$(cd "$(dirname "$0")" && pwd)

if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "# setting up $venv (torch from PyPI)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch
fi
py="$venv/bin/python"
[ -x "$zinf" ] || { echo "cpu_vs_torch: $zinf is not built (scripts/setup.sh)" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/mem.json" <<JSON
{"zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
 "offload_optimizer": {"device": "none"}},
 "zinf": {"device": "emulated", "device_bytes": "8G", "host_bytes": "1G"}}
JSON

# zinf L C H S -> "mean_ms sys_share"
run_zinf() {
  if ! OMP_NUM_THREADS=$threads "$zinf" train --config "$tmp/mem.json" --data "$data" \
      --layers "$1" --dim "$2" --heads "$3" --seq "$T" --batch "$B" --steps "$4" \
      --precision fp32 --log "$tmp/z.jsonl" > "$tmp/z.out" 2> "$tmp/z.err"; then
    echo "cpu_vs_torch: zinf train failed:" >&2
    grep -v 'runs unpinned' "$tmp/z.err" >&2
    return 1
  fi
  python3 - "$tmp/z.jsonl" <<'PY'
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if 'step' in r][1:]
ms = sum(r['ms'] for r in steps) / len(steps)
user = sum(r['cpu_user_s'] for r in steps)
sys_ = sum(r['cpu_sys_s'] for r in steps)
print('%.1f %.3f' % (ms, sys_ / (user + sys_)))
PY
}

# torch L C H S -> "mean_ms params"
run_torch() {
  OMP_NUM_THREADS=$threads "$py" "$here/torch_gpt_bench.py" --data "$data" --layers "$1" \
    --dim "$2" --heads "$3" --seq "$T" --batch "$B" --steps "$4" --threads "$threads" \
    2> "$tmp/t.err" > "$tmp/t.json" || { cat "$tmp/t.err" >&2; return 1; }
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print("%.1f %d" % (r["mean_ms"], r["params"]))' "$tmp/t.json"
}

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR] = $1} END { print a[int((NR + 1) / 2)] }'; }

echo "# cpu_vs_torch: batch $B x seq $T, $threads threads, fp32, activation checkpointing, $rounds rounds"
echo "# torch $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null), $(uname -sr), $(nproc) cpus: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
printf "# %-10s %10s %5s %10s %10s %7s %8s\n" shape params round torch_ms zinf_ms ratio zinf_sys
status=0
for shape in $shapes; do
  IFS=x read -r L C H <<< "$shape"
  S=${STEPS:-}
  if [ -z "$S" ]; then if [ "$C" -ge 512 ]; then S=5; else S=12; fi; fi
  tms=() zms=() ratios=() shares=()
  for ((i = 1; i <= rounds; i++)); do
    read -r tm params < <(run_torch "$L" "$C" "$H" "$S") || exit 1
    read -r zm share < <(run_zinf "$L" "$C" "$H" "$S") || exit 1
    r=$(awk -v a="$zm" -v b="$tm" 'BEGIN { printf "%.3f", a / b }')
    tms+=("$tm") zms+=("$zm") ratios+=("$r") shares+=("$share")
    printf "  %-10s %10d %5d %10.1f %10.1f %7s %7.1f%%\n" "$shape" "$params" "$i" "$tm" "$zm" "$r" \
      "$(awk -v s="$share" 'BEGIN { print s * 100 }')"
  done
  mr=$(echo "${ratios[*]}" | median)
  ms=$(echo "${shares[*]}" | median)
  ok=$(awk -v r="$mr" -v t="$target" -v s="$ms" 'BEGIN { print (r <= t && s <= 0.10) ? "met" : "NOT met" }')
  [ "$ok" = met ] || status=1
  echo "# $shape: median torch $(echo "${tms[*]}" | median) ms, zinf $(echo "${zms[*]}" | median) ms, zinf / torch $mr (target <= $target), zinf system time $(awk -v s="$ms" 'BEGIN { printf "%.1f", s * 100 }')% of its steps' CPU time (target <= 10%): $ok"
done

# The losses of both from zinf's initial weights and batches: L C H S -> a table and the
# largest relative difference.
check_shape() {
  OMP_NUM_THREADS=$threads "$zinf" train --config "$tmp/mem.json" --data "$data" --layers "$1" \
    --dim "$2" --heads "$3" --seq "$T" --batch "$B" --steps 0 --precision fp32 \
    --export "$tmp/init.safetensors" > /dev/null 2> "$tmp/z.err" || { cat "$tmp/z.err" >&2; return 1; }
  rm -f "$tmp/c.jsonl"
  OMP_NUM_THREADS=$threads "$zinf" train --config "$tmp/mem.json" --data "$data" --layers "$1" \
    --dim "$2" --heads "$3" --seq "$T" --batch "$B" --steps "$4" --precision fp32 \
    --log "$tmp/c.jsonl" > /dev/null 2> "$tmp/z.err" || { cat "$tmp/z.err" >&2; return 1; }
  OMP_NUM_THREADS=$threads "$py" "$here/torch_gpt_bench.py" --data "$data" --layers "$1" \
    --dim "$2" --heads "$3" --seq "$T" --batch "$B" --steps "$4" --threads "$threads" \
    --init "$tmp/init.safetensors" 2> "$tmp/t.err" > "$tmp/t.json" || { cat "$tmp/t.err" >&2; return 1; }
  python3 - "$tmp/c.jsonl" "$tmp/t.json" "$1x$2x$3" <<'PY'
import json, sys
z = [r['loss'] for r in map(json.loads, open(sys.argv[1])) if 'step' in r]
t = json.load(open(sys.argv[2]))['losses']
worst = 0
for i, (a, b) in enumerate(zip(z, t)):
    d = abs(a - b) / abs(b)
    worst = max(worst, d)
    if i < 3 or i == len(z) - 1 or d == worst:
        print("  %-10s %5d %14.9g %14.9g %10.2e" % (sys.argv[3], i + 1, a, b, d))
print("# %s: %d steps from the same weights and batches, largest relative loss difference %.2e" % (sys.argv[3], len(z), worst))
PY
}

if [ "${CHECK:-1}" = 1 ]; then
  echo "# the same math: zinf's initial weights (--export) and batches in PyTorch, losses compared"
  printf "# %-10s %5s %14s %14s %10s\n" shape step zinf_loss torch_loss rel_diff
  for shape in $shapes; do
    IFS=x read -r L C H <<< "$shape"
    if [ "$C" -ge 512 ]; then cs=${CHECK_STEPS:-10}; else cs=${CHECK_STEPS:-50}; fi
    check_shape "$L" "$C" "$H" "$cs" || exit 1
  done
fi
exit $status
